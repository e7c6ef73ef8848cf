"""Peak memory of the actor's training micro-batch with a 151,936-token vocabulary: main before issue 13 vs now.

    python bench/memory.py                      # micro-batch 4 x 1,024 response tokens (needs ~13 GiB free for "old")
    python bench/memory.py --response-tokens 256  # a smaller check

One forward and backward of the actor's loss on a micro-batch, as PPOModule runs it: the LM head on the response
positions, log-probs of the sampled tokens, the entropy metric (ppo.entropy_coef=0), a policy-gradient loss,
backward. The model is Qwen2-shaped with Qwen2.5's vocabulary and a small body (hidden 64, 2 layers, random
weights, float32, CPU), so that the logits dominate as they do at real size.

- old: the code of main at 120aba8 (issue 13's base), its two functions read with `git show`:
  module.token_logprobs (float32 log-softmax via logsumexp over the whole [B, T, V]) and
  algorithms.entropy_from_logits (softmax, shifted logits, logsumexp: several [B, T, V] float32 copies).
- new: lit_ppo.logits.logprobs_and_entropy, which the module calls now (chunked float32, one autograd function).

Each variant runs in its own process; the figure is the peak resident memory of the step above the resident
memory before it (Linux VmHWM, reset through /proc/self/clear_refs before the step): what the operating system
had to give the step, every allocation included (a memory profiler on tensors would miss allocator overhead).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_COMMIT = "120aba8"
GIB = 1024**3


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def load_old(path: str, function: str):
    """One function of lit_ppo as it was at BASE_COMMIT, read with `git show` and compiled alone (with torch in
    scope): the rest of that old file imports names that have moved since, and the function needs none of them."""
    source = subprocess.run(
        ["git", "show", f"{BASE_COMMIT}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == function)
    import torch

    namespace = {"torch": torch, "Tensor": torch.Tensor}
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"{BASE_COMMIT}:{path}", "exec"), namespace)
    return namespace[function]


def run_variant(args) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=args.prompt_tokens + args.response_tokens + 8,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config).float().train()
    B, P, T = args.micro_batch, args.prompt_tokens, args.response_tokens
    input_ids = torch.randint(0, args.vocab_size, (B, P + T))
    targets = input_ids[:, P:]
    advantages = torch.randn(B, T)
    if args.variant == "old":
        token_logprobs = load_old("lit_ppo/module.py", "token_logprobs")
        entropy_from_logits = load_old("lit_ppo/algorithms.py", "entropy_from_logits")

        def step():
            logits = model(input_ids=input_ids, logits_to_keep=T + 1).logits[:, :T]
            logp = token_logprobs(logits, targets)
            entropy = entropy_from_logits(logits.detach())  # entropy_coef = 0, as in _actor_backward
            loss = -(logp * advantages).mean()
            loss.backward()
            return float(entropy.mean())
    else:
        from lit_ppo.logits import logprobs_and_entropy

        def step():
            logits = model(input_ids=input_ids, logits_to_keep=T + 1).logits
            logp, entropy = logprobs_and_entropy(logits, targets)
            loss = -(logp * advantages).mean()
            loss.backward()
            return float(entropy.mean())

    before_kib = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    started = time.perf_counter()
    entropy = step()
    seconds = time.perf_counter() - started
    peak_kib = status_kib("VmHWM")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    return {
        "variant": args.variant,
        "peak_above_start_gib": (peak_kib - before_kib) / 1024**2,
        "start_gib": before_kib / 1024**2,
        "seconds": seconds,
        "entropy": entropy,
        "grad_norm": grad_norm,
    }


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024**2
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=151_936)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--variant", choices=["old", "new"], help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    copy_gib = args.micro_batch * args.response_tokens * args.vocab_size * 4 / GIB
    print(f"$ {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"micro-batch {args.micro_batch} x {args.response_tokens} response tokens (+{args.prompt_tokens} prompt), "
        f"vocabulary {args.vocab_size:,}: one float32 copy of the logits = {copy_gib:.2f} GiB"
    )
    results = {}
    for variant in ("new", "old"):
        needed = 5.5 * copy_gib if variant == "old" else 2.5 * copy_gib
        if available_gib() < needed:
            print(f"{variant}: skipped, {available_gib():.1f} GiB available < {needed:.1f} GiB it may need")
            continue
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--variant", variant], cwd=ROOT, capture_output=True, text=True
        )
        if child.returncode != 0:
            print(f"{variant}: failed\n{child.stderr[-2000:]}")
            continue
        results[variant] = json.loads(child.stdout.strip().splitlines()[-1])
        r = results[variant]
        print(
            f"{variant:>4}: peak {r['peak_above_start_gib']:6.2f} GiB above the {r['start_gib']:.2f} GiB before the step "
            f"({r['peak_above_start_gib'] / copy_gib:.1f} logits copies), {r['seconds']:.1f} s, "
            f"entropy {r['entropy']:.4f}, grad norm {r['grad_norm']:.6f}"
        )
    if len(results) == 2:
        print(f"old / new peak: {results['old']['peak_above_start_gib'] / results['new']['peak_above_start_gib']:.2f}x")


if __name__ == "__main__":
    main()
