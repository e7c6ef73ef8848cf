"""MFU of the training phase: lit-ppo's against a plain PyTorch loop (bench/train_phase.py's), in model FLOP/s and
as a share of the measured matmul peak (issue 14).

    python bench/mfu.py --repeats 3                       # on a GPU: the Qwen2.5-0.5B shape, bf16-mixed
    .venv/bin/python bench/mfu.py --device cpu --repeats 5  # on a CPU: the 24 M bench model
    .venv/bin/python bench/mfu.py --device cpu --smoke      # checks that it runs (tiny shapes)

The matmul peak: n x n x n products (2 n^3 FLOPs each) after warm-up, in bf16 and float32 (and TF32 on CUDA). The
training phase: GRPO on a fixed batch (16 prompts x 4 samples, 2 AdamW steps of 32 in micro-batches of 8), both loops
at the precision `precision: auto` resolves to here (bf16-mixed on a GPU), 3 rollout steps per run of which the first
is warm-up; the loops alternate. `--profile` also runs each loop once under torch.profiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time

import torch
from common import (
    BENCH_MODEL,
    arithmetic_prompt_file,
    build_model_dir,
    command_line,
    model_description,
    print_header,
    qwen05b_model_dir,
)
from train_phase import run_litppo, run_plain

from lit_ppo.model_shape import ModelShape
from lit_ppo.precision import resolve_precision
from lit_ppo.testing import random_rollout_batch

PRECISION_WORDS = {
    "bf16-mixed": "float32 weights and AdamW, bf16 autocast",
    "32-true": "float32 throughout",
    "bf16-true": "bf16 weights and AdamW",
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, repeats: int, inner: int) -> dict:
    """FLOP/s of n x n x n matmuls (2 n^3 each): `repeats` timings of `inner` back-to-back products after warm-up."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(inner):
            a @ b
        synchronize(device)
        rates.append(2 * n**3 * inner / (time.perf_counter() - started))
    return {"mean": sum(rates) / len(rates), "max": max(rates), "n": n}


def training_flops(shape: ModelShape, sequences: int, prompt_tokens: int, response_tokens: int) -> float:
    """Model FLOPs of one pass of training (forward + backward) over the batch:
    6 x (decoder-layer parameters) x (all positions) + 6 x vocab x hidden x (response positions: the LM head runs
    only where it predicts a response token) + 12 x layers x q_dim x S^2 per sequence (attention scores and
    values, PaLM's count, no causal halving); S = prompt + response tokens."""
    S = prompt_tokens + response_tokens
    body = 6 * shape.num_layers * shape.layer_parameters() * sequences * S
    head = 6 * shape.vocab_size * shape.hidden_size * sequences * response_tokens
    attention = 12 * shape.num_layers * shape.q_dim * S * S * sequences
    return float(body + head + attention)


def prime_rl_flops_per_token(config: dict, lora_parameters: int, seq_len: int) -> float:
    """Model FLOPs per trained token as prime-rl counts them for its published MFU (PrimeIntellect-ai/prime-rl,
    src/prime_rl/trainer/perf.py, `PerfCounter`, read at commit 0e6c67fc): non-attention + attention, where
    - non-attention: the matmul parameters N = q, k, v, o (heads x head_dim, no biases) + 3 x hidden x intermediate per
      layer + the LM head (vocab x hidden, at every position; the input embedding is not a matmul); full training
      6 x N, with LoRA 4 x N (the frozen base's forward and input gradient) + 6 x the adapters' parameters;
    - attention: 12 x layers x heads x (hidden / heads) x seq_len per token, where `seq_len` is its benchmark's
      sequence length (the packed micro-batch's 16,384 tokens, not each sample's; no causal halving). Its published
      single-H100 points follow from this with seq_len 16,384: Qwen3-0.6B 9.21 GFLOP/token (11.9k tok/s = 11.1 %),
      Qwen3-4B LoRA r16 34.4 (6.23k = 21.7 %), OLMo-3-7B LoRA r16 53.6 (5.35k = 29.0 %) of 989 TFLOP/s (OLMo-3-7B
      taken as 32 layers, hidden 4096, 32 heads and KV heads, intermediate 11008, vocabulary 100278)."""
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention_params = layers * hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp_params = layers * 3 * config["intermediate_size"] * hidden
    matmul_params = attention_params + mlp_params + config["vocab_size"] * hidden
    body = 4 * matmul_params + 6 * lora_parameters if lora_parameters else 6 * matmul_params
    return float(body + 12 * layers * heads * (hidden // heads) * seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks that the script runs")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repetitions of each loop")
    parser.add_argument(
        "--model",
        choices=["0.5b", "24m"],
        default=None,
        help="the Qwen2.5-0.5B shape (default on cuda) or the 24 M bench model (default on cpu)",
    )
    parser.add_argument("--profile", action="store_true", help="also run each loop once under torch.profiler")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; fix: run on a GPU machine or pass --device cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    small = (args.model or ("0.5b" if cuda else "24m")) == "24m"
    if args.smoke:
        model_dir = qwen05b_model_dir(smoke=True)
    elif small:
        model_dir = build_model_dir(dataclasses.replace(BENCH_MODEL, max_position_embeddings=2048))
    else:
        model_dir = qwen05b_model_dir()
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    # The precision a run gets here with `precision: auto`: bf16-mixed on a GPU, float32 on a CPU without native bf16.
    precision = resolve_precision("auto", args.device)
    peak_dtype = "float32" if precision == "32-true" else "bf16"
    # run_litppo / run_plain's settings; the 24 M model's lengths are bench/train_phase.py's workload.
    run = argparse.Namespace(
        rollout_batch_size=16,
        samples_per_prompt=4,
        train_batch_size=32,
        micro_batch_size=8,
        response_tokens=64 if small else 512,
        steps=3,
        lr=1e-5,
        seed=args.seed,
    )
    prompt_tokens = 16 if small else 128
    if args.smoke:
        vars(run).update(rollout_batch_size=4, samples_per_prompt=2, train_batch_size=4, micro_batch_size=2)
        vars(run).update(response_tokens=16, steps=2)
        prompt_tokens, args.repeats = 8, 1
    print_header(
        "MFU of the training phase: lit-ppo against a plain PyTorch loop",
        args,
        device=str(torch.cuda.get_device_name(device) if cuda else device),
        model=model_description(model_dir),
        batch=f"{run.rollout_batch_size} prompts x {run.samples_per_prompt} samples x ({prompt_tokens} prompt + "
        f"{run.response_tokens} response) tokens; AdamW steps of {run.train_batch_size} in micro-batches of "
        f"{run.micro_batch_size}; {precision} ({PRECISION_WORDS[precision]})",
        runs=f"{args.repeats} repetitions x 2, alternating, {run.steps} rollout steps each (first is warm-up)",
    )

    # On a CPU an 8192^3 product takes minutes: 2048^3 reaches its peak already. A CPU without native bf16
    # emulates it at a small fraction of its float32 rate: a smaller product suffices there.
    n, repeats, inner = (512, 3, 4) if args.smoke else ((8192, 5, 10) if cuda else (2048, 3, 3))
    bf16_n = n if cuda or args.smoke else 1024
    peaks = {
        "bf16": matmul_peak(device, torch.bfloat16, bf16_n, repeats, 1 if bf16_n != n else inner),
        "float32": matmul_peak(device, torch.float32, n, repeats, inner // 2 or 1),
    }
    if cuda:
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        peaks["tf32"] = matmul_peak(device, torch.float32, n, repeats, inner)
        torch.set_float32_matmul_precision(previous)
    print(f"matmul peak (n = {n}; bf16 n = {bf16_n}; mean and max of {repeats} x {inner} products after warm-up):")
    for name, p in peaks.items():
        print(f"  {name:<8} {p['mean'] / 1e12:.4g} TFLOP/s mean, {p['max'] / 1e12:.4g} max")
    free_memory()

    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    prompts = torch.randint(4, 100, (run.rollout_batch_size, prompt_tokens), generator=torch.Generator().manual_seed(1))
    # ids 4..99: the character tokenizer's ordinary tokens
    batch = random_rollout_batch(
        prompts.tolist(), run.samples_per_prompt, run.response_tokens, range(4, 100), args.seed
    )
    N, P, T = len(batch.response_ids), prompt_tokens, run.response_tokens
    flops = training_flops(shape, N, P, T)
    prompt_file = arithmetic_prompt_file(64)

    def one_run(name: str, settings: argparse.Namespace) -> dict:
        if name == "lit-ppo":
            return run_litppo(settings, model_dir, prompt_file, batch, accelerator=args.device, precision=precision)
        return run_plain(settings, model_dir, batch, pad_id, device=str(device), precision=precision)

    results: dict[str, list[float]] = {"lit-ppo": [], "plain": []}
    for rep in range(args.repeats):
        for name in ("lit-ppo", "plain") if rep % 2 == 0 else ("plain", "lit-ppo"):
            seconds = one_run(name, run)["train_s"]
            results[name] += seconds
            print(f"repetition {rep + 1} {name}: training phase {', '.join(f'{s:.3f}' for s in seconds)} s", flush=True)
            free_memory()
    if args.profile:
        # Where lit-ppo's training phase spends what the plain loop does not. The tables are of whole runs (model
        # loading included); the operators that differ are what matters.
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        for name in ("lit-ppo", "plain"):
            with profile(activities=activities) as prof:
                r = one_run(name, argparse.Namespace(**{**vars(run), "steps": 2}))
            print(f"\nprofile: {name} (training phases {r['train_s']} s), top operators by {sort}\n", flush=True)
            print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60), flush=True)
            free_memory()

    print("-" * 100)
    print(f"model FLOPs per training phase {flops:.3e} = {' '.join(training_flops.__doc__.split(':', 1)[1].split())}")
    print(f"MFU = model FLOP/s / the measured {peak_dtype} matmul peak (mean)")
    print("| loop | timed steps | median s | tokens/s (all positions) | response tokens/s | model TFLOP/s | MFU |")
    print("|---|---|---|---|---|---|---|")
    medians = {}
    for name, seconds in results.items():
        s = medians[name] = sorted(seconds)[len(seconds) // 2]
        mfu = flops / s / peaks[peak_dtype]["mean"]
        print(
            f"| {name} | {len(seconds)} | {s:.4g} | {N * (P + T) / s:.4g} | {N * T / s:.4g} | {flops / s / 1e12:.4g} | {mfu:.1%} |"
        )
    print(f"lit-ppo / plain loop tokens per second: {medians['plain'] / medians['lit-ppo']:.3f} (medians; goal >= 0.9)")
    print(f"command : {command_line()}")


if __name__ == "__main__":
    main()
