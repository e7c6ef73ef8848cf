"""Peak memory per rank of one training forward and backward under context parallelism (issue 51 item 3), CPU.

C gloo processes (C = 1, 2, 4) each build the same model (a Qwen2-shaped model with random weights: hidden 256, 4
layers, 8 heads, 4 KV heads, the character vocabulary) and run the actor's log-probs of one row of `--tokens` tokens
(half prompt, half response; no padding, so sdpa's is_causal and no [L, L] mask, as the one-rank forward) forward and
backward: one process with the product's `models.response_logprobs_and_entropy`, C > 1 with
`context_parallel.context_parallel_logprobs` (each rank 1/C of the row, the Ulysses exchange around attention).

Counted per rank: the growth of the process's peak resident memory (getrusage's ru_maxrss) over the forward and
backward, from just before the forward (the model built, the batch laid out): activations, saved tensors,
gradients, the exchange's buffers, the allocator's slack. Seconds beside it (wall, on a shared machine).

    .venv/bin/python bench/context_parallel_memory.py                  # C = 1, 2, 4 on 4,096 tokens
    .venv/bin/python bench/context_parallel_memory.py --tokens 16384   # the issue's 16k rows (minutes, GiBs)
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def rank_main(rank: int, size: int, tokens: int, store: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model
    from lit_ppo.topology import RankTopology
    from lit_ppo.training.batching import pack
    from lit_ppo.training.context_parallel import ContextGroup, context_parallel_logprobs
    from lit_ppo.training.models import prepare_for_training, response_logprobs_and_entropy

    tokenizer = build_char_tokenizer()
    shape = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768)
    model = build_tiny_model(tokenizer, **shape, max_position_embeddings=tokens + 8, seed=0)
    model = prepare_for_training(model, False)
    g = torch.Generator().manual_seed(0)
    prompt, response = (torch.randint(3, 90, (tokens // 2,), generator=g).tolist() for _ in range(2))
    mb = pack([prompt], [response], tokenizer.pad_token_id, "cpu")
    topology = RankTopology(rank=rank, world_size=size, context_parallel_size=size).with_groups()
    dist.barrier()
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.time()
    if size == 1:
        logp, _ = response_logprobs_and_entropy(model, mb, 1.0)
    else:
        logp, _ = context_parallel_logprobs(model, mb, ContextGroup.of(topology), 1.0)
    logp.sum().backward()
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    Path(out, f"{size}_{rank}.json").write_text(json.dumps(dict(mib=growth, seconds=time.time() - start)))


def measure(size: int, tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        store = f"{directory}/store"
        mp.start_processes(rank_main, args=(size, tokens, store, directory), nprocs=size, start_method="spawn")
        return [json.loads(Path(directory, f"{size}_{r}.json").read_text()) for r in range(size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--sizes", default="1,2,4", help="the context-parallel sizes C to measure")
    args = parser.parse_args()
    print(
        f"| C | peak growth per rank, MiB (max over ranks) | vs C = 1 | seconds (max over ranks) |  ({args.tokens} tokens)"
    )
    print("|---|---|---|---|")
    baseline = None
    for size in (int(s) for s in args.sizes.split(",")):
        ranks = measure(size, args.tokens)
        mib, seconds = max(r["mib"] for r in ranks), max(r["seconds"] for r in ranks)
        baseline = baseline or mib
        print(f"| {size} | {mib:,.0f} | {mib / baseline:.2f}x | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
