"""Peak memory per rank of the training step under context parallelism (issue 51 item 3), CPU, float32.

One rollout step of the real training step (the Lightning trainer and `PPOModule.training_step`: PPO with a critic
and a reference model, `ppo=ppo`'s settings, as tests/training/test_context_parallel.py runs it) on one rollout batch
of one sample whose prompt and response make one row of `--tokens` tokens (`--prompt-tokens` of prompt), at
C = 1 (one process, `strategy=single`), C = 2 (two gloo processes, `strategy=ddp devices=2 context_parallel_size=2`)
and C = 4. The step: the experience forwards (reference log-probs, values; the old log-probs are the training
forward's, exactly on-policy), GAE, one optimizer step of the actor and one of the critic (each a forward and
backward of the whole row, 1/C of it per rank). `--layout padded` (a micro-batch of `--samples` rows, right/left
padded) or `packed` (the samples end to end in one row). The model: a Qwen2-shaped model with random weights
(`--hidden`, `--layers`, 8 heads, 4 KV heads: both divide by 4; the character vocabulary), small enough that the
row's activations dominate a rank's memory, which is what C divides.

Measured per rank: the growth of the process's peak resident memory over the rollout step: at the step's start
(`training_step`, the models built, the optimizers made) the kernel's peak (VmHWM) is reset to the current resident
memory (`echo 5 > /proc/self/clear_refs`) and that resident memory (VmRSS) read; at its end the peak read again
(also at the ends of the experience and of the updates: the phases' peaks). Peak growth = peak - resident at the
start: activations, saved tensors, masks, gradients, the optimizers' first states, the exchange's buffers, the
allocator's slack. Seconds: the step's wall seconds (one torch thread per rank: on a loaded machine they are the
machine's, not the method's). The per-token losses of every C are printed beside (the same step: the C ranks
compute the one rank's loss).

    .venv/bin/python bench/context_parallel_memory.py                         # C = 1, 2, 4 on one 16,384-token row
    MALLOC_MMAP_THRESHOLD_=1048576 .venv/bin/python bench/context_parallel_memory.py   # the tensors' peak, not the heap's
    .venv/bin/python bench/context_parallel_memory.py --tokens 16383 --sizes 1,2   # a row not divisible by C
    .venv/bin/python bench/context_parallel_memory.py --layout packed --samples 2  # two 8k samples in one row
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HEADS, KV_HEADS = 8, 4


def _status(field: str) -> float:
    """/proc/self/status's `field` (VmRSS, VmHWM) in MiB."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _shape(args) -> dict:
    return dict(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        intermediate_size=3 * args.hidden,
    )


def _lengths(args) -> list[tuple[int, int]]:
    """(prompt, response) tokens of each sample: `--samples` samples sharing `--tokens` (the last one takes the
    rest), each with `--prompt-tokens` / samples of prompt."""
    per = args.tokens // args.samples
    sizes = [per] * (args.samples - 1) + [args.tokens - per * (args.samples - 1)]
    prompt = args.prompt_tokens // args.samples
    return [(prompt, n - prompt) for n in sizes]


def _inputs(args, root: Path, size: int):
    from lit_ppo.config import StrategyConfig
    from lit_ppo.plan import compute_plan
    from lit_ppo.run.entry import compose_run_config
    from lit_ppo.testing import rollout_batch_from_ids
    from tests.helpers import ppo_at, run_config

    lengths = _lengths(args)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(4, 40, (r,), generator=g).tolist() for _, r in lengths]
    n = len(lengths)  # one prompt each, one sample per prompt: one optimizer step of them all
    batch = rollout_batch_from_ids(prompts, responses, 1, torch.linspace(1.0, 0.0, n))
    ppo = ppo_at(n, 1, n, n, "ppo", packing=args.layout == "packed", shared_prefix=False)
    longest = max(p + r for p, r in lengths)
    rollout = dataclasses.replace(
        compose_run_config().rollout, max_response_tokens=max(r for _, r in lengths), max_model_len=longest
    )
    strategy = StrategyConfig(name="ddp" if size > 1 else "single", accelerator="cpu", devices=size)
    strategy = dataclasses.replace(strategy, precision="32-true", context_parallel_size=size)
    config = dataclasses.replace(run_config(ppo=ppo, rollout=rollout, steps=1), strategy=strategy)
    return batch, ppo, rollout, lambda prompts: compute_plan(config, prompts)


def _measured(module, record: dict) -> None:
    """Wraps `module`'s rollout step (its class's, in this rank's process: Lightning reads the hook's signature
    there) and its two phases with the peak's resets and readings (into `record`)."""
    step, experience, updates = type(module).training_step, module.make_experience, module.train_on_experience

    def training_step(self, dataloader_iter):  # the parameter's name: Lightning passes the iterator by it
        gc.collect()  # what the set-up left for the collector and the C library's free lists: not the step's
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        _reset_peak()
        record["before_mib"], started = _status("VmRSS"), time.perf_counter()
        step(self, dataloader_iter)
        record["seconds"] = time.perf_counter() - started
        record["rest_peak_mib"] = _status("VmHWM")

    def make_experience(batch):
        exp = experience(batch)
        record["experience_peak_mib"] = _status("VmHWM")
        _reset_peak()
        return exp

    def train_on_experience(batch, exp):
        out = updates(batch, exp)
        record["train_peak_mib"] = _status("VmHWM")
        _reset_peak()
        return out

    type(module).training_step = training_step
    module.make_experience, module.train_on_experience = make_experience, train_on_experience


def rank_main(rank: int, size: int, args, model_dir: str, prompt_file: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(size), NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank))
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    from lightning.pytorch.strategies import DDPStrategy

    from tests.helpers.fixed_batch import train_on_fixed_batch

    root = Path(out, f"rank{rank}")
    batch, ppo, rollout, plan_for = _inputs(args, root, size)
    record: dict = {"start_rss_mib": _status("VmRSS")}
    trainer = (
        dict(devices=size, strategy=DDPStrategy(process_group_backend="gloo", find_unused_parameters=True))
        if size > 1
        else {}
    )
    module, _ = train_on_fixed_batch(
        model_dir,
        prompt_file,
        root,
        batch,
        ppo,
        rollout,
        plan_for,
        grads_of=None,
        prepare=lambda m: _measured(m, record),
        temperature=0.7,
        **trainer,
    )
    row = module.history[-1]
    record.update({k: row[k] for k in ("actor/policy_loss", "critic/value_loss", "actor/entropy") if k in row})
    record.update({k: row[k] for k in ("timing/experience_s", "timing/train_s")})
    record["attention"] = module.actor.config._attn_implementation
    Path(out, f"{rank}.json").write_text(json.dumps(record))


def measure(size: int, args, model_dir: str, prompt_file: str) -> list[dict]:
    from tests.helpers import free_port

    with tempfile.TemporaryDirectory(prefix="cpbench_") as directory:
        mp.start_processes(
            rank_main,
            args=(size, args, model_dir, prompt_file, free_port(), directory),
            nprocs=size,
            start_method="spawn",
        )
        ranks = [json.loads(Path(directory, f"{r}.json").read_text()) for r in range(size)]
        print(f"# C = {size}, per rank: {json.dumps(ranks)}", flush=True)
        return ranks


def _files(args, directory: Path) -> tuple[str, str]:
    """The model (random weights, seeded) and a prompt file (the fixed batch replaces its prompts), built once."""
    from lit_ppo.demo.arithmetic import make_problems, write_jsonl
    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, **_shape(args), max_position_embeddings=args.tokens + 64, seed=0)
    save_model_dir(model, tokenizer, directory / "model")
    write_jsonl(make_problems(seed=0, max_operand=20, n_train=16, n_eval=1)[0], directory / "train.jsonl")
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"model   : Qwen2 hidden {args.hidden}, {args.layers} layers, {HEADS} heads, {KV_HEADS} KV heads, "
        f"intermediate {3 * args.hidden}, vocabulary {model.config.vocab_size}, {parameters / 1e6:.2f} M parameters "
        f"(actor; the critic and the reference the same shape), float32"
    )
    return str(directory / "model"), str(directory / "train.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of the row (prompts + responses)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="of which prompt tokens (all samples)")
    parser.add_argument("--samples", type=int, default=1, help="samples sharing the tokens")
    parser.add_argument("--layout", choices=("padded", "packed"), default="padded")
    parser.add_argument("--sizes", default="1,2,4", help="the context-parallel sizes C to measure")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(f"command : {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"date    : {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"uptime  : {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"torch   : {torch.__version__}; one torch thread per rank; {os.cpu_count()} CPUs")
    print(f"rows    : layout {args.layout}, samples (prompt, response) {_lengths(args)}")
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(
        f"malloc  : {malloc or 'glibc defaults (a dynamic mmap threshold: freed blocks of up to 32 MiB stay in the heap)'}"
    )
    with tempfile.TemporaryDirectory(prefix="cpbench_files_") as directory:
        model_dir, prompt_file = _files(args, Path(directory))
        print(
            "| C | peak growth per rank, MiB (max over ranks; experience / updates) | vs C = 1 | "
            "resident at the step's start, MiB | s / step (experience + updates) | entropy, value loss (rank 0) |"
        )
        print("|---|---|---|---|---|---|", flush=True)
        baseline = None
        for size in (int(s) for s in args.sizes.split(",")):
            ranks = measure(size, args, model_dir, prompt_file)
            peaks = [
                {
                    phase: r[f"{phase}_peak_mib"] - r["before_mib"]
                    for phase in ("experience", "train", "rest")
                    if f"{phase}_peak_mib" in r
                }
                for r in ranks
            ]
            growth = max(max(p.values()) for p in peaks)
            baseline = baseline or growth
            worst = max(range(size), key=lambda r: max(peaks[r].values()))
            r0 = ranks[0]
            if baseline == growth:
                print(f"(the models' attention implementation as loaded: {r0['attention']})")
            print(
                f"| {size} | {growth:,.0f} ({peaks[worst]['experience']:,.0f} / {peaks[worst]['train']:,.0f}) | "
                f"{growth / baseline:.2f}x | {max(r['before_mib'] for r in ranks):,.0f} | "
                f"{max(r['seconds'] for r in ranks):.1f} ({r0['timing/experience_s']:.1f} + {r0['timing/train_s']:.1f}) | "
                f"{r0['actor/entropy']:.7g}, {r0['critic/value_loss']:.7g} |",
                flush=True,
            )
    print(f"uptime  : {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
