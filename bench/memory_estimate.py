"""The memory pre-flight (lit_ppo/memory.py) against the measured peak of a real training phase on CPU.

    .venv/bin/python bench/memory_estimate.py            # tiny and 24 M models, with and without checkpointing
    .venv/bin/python bench/memory_estimate.py --smoke    # checks that it runs

For each model and setting, a child process trains one rollout step for real (a Lightning trainer fitting a
PPOModule: PPO preset with critic and reference, float32, CPU) on a fixed rollout batch, as
bench/train_phase.py does. Measured: the peak resident memory of the rollout step (Linux VmHWM, reset through
/proc/self/clear_refs when the step starts) above the resident memory before the module was built, so the
weights, gradients, AdamW states, activations and logits are in it and the Python/torch runtime is not; the
children run with glibc's mmap threshold fixed (MMAP_THRESHOLD_BYTES, below) so that freed tensors leave.
Estimated: `estimate_memory(...).training_bytes` for the same shape and settings. The goal is within +-30%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L  # noqa: E402 (after common, which sets up the path)
from common import (
    BENCH_MODEL,
    CACHE,
    ROOT,
    ModelSize,
    arithmetic_prompt_file,
    build_model_dir,
    build_run,
    command_line,
    model_description,
)
from train_phase import FixedBatchDataModule, NullEngine, make_fixed_batch

from lit_ppo.config import PPOConfig  # noqa: E402
from lit_ppo.memory import GIB, MemoryInputs, ModelShape, estimate_memory  # noqa: E402

TINY = ModelSize(
    hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, max_position_embeddings=1024
)
# glibc keeps freed blocks below its dynamic mmap threshold (up to 32 MiB) in the heap, so the resident size would
# also count blocks the allocator holds but no tensor uses (0.80 GiB instead of 0.49 GiB for the tiny model without
# checkpointing); a fixed 64 KiB threshold maps every tensor on its own and returns it when freed, so the resident
# peak follows the live tensors, which is what the estimate counts (and what a GPU allocator reports as allocated).
MMAP_THRESHOLD_BYTES = 65536
MODELS = {"tiny": TINY, "24m": dataclasses.replace(BENCH_MODEL, max_position_embeddings=1024)}


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


class PeakOfStep(L.Callback):
    """Resets the resident high-water mark when the rollout step starts and reads it when it ends."""

    peak_kib = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        Path("/proc/self/clear_refs").write_text("5")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.peak_kib = max(self.peak_kib, status_kib("VmHWM"))


def measure(args) -> dict:
    from transformers import AutoTokenizer

    from lit_ppo.prompts import load_prompts

    model_dir = build_model_dir(MODELS[args.model])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_file = arithmetic_prompt_file(64)
    prompt_ids = [p.prompt_ids for p in load_prompts(prompt_file, tokenizer).prompts[: args.prompts]]
    batch = make_fixed_batch(prompt_ids, args.samples, args.response_tokens, range(4, len(tokenizer)), seed=0)
    ppo = PPOConfig(
        rollout_batch_size=args.prompts,
        n_samples_per_prompt=args.samples,
        train_batch_size=args.prompts * args.samples,
        micro_train_batch_size=args.micro_batch,
        kl_coef=0.01,
    )
    peak = PeakOfStep()
    before_kib = status_kib("VmRSS")
    trainer, module, datamodule, plan = build_run(
        model_dir,
        prompt_file,
        ppo,
        max_response_tokens=args.response_tokens,
        total_rollout_steps=1,
        engine=NullEngine(),
        out_dir=CACHE / "memory_estimate",
        callbacks=[peak],
        datamodule_class=FixedBatchDataModule,
        gradient_checkpointing=args.checkpointing,
    )
    datamodule.fixed_batch = batch
    trainer.fit(module, datamodule=datamodule)
    shape = ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    estimate = estimate_memory(
        shape,
        MemoryInputs(
            precision="32-true",
            strategy="single",
            data_parallel_size=1,
            micro_batch_size=args.micro_batch,
            prompt_tokens=max(len(p) for p in prompt_ids),
            response_tokens=args.response_tokens,
            gradient_checkpointing=args.checkpointing,
            critic=plan.critic_enabled,
            reference=plan.reference_enabled,
            rollout_dtype="float32",
            rollout_sequences=plan.samples_per_rank_per_rollout_step,
            max_model_len=1024,
            on_gpu=False,
        ),
    )
    return {
        "measured_gib": (peak.peak_kib - before_kib) / 1024**2,
        "estimated_gib": estimate.training_bytes / GIB,
        "rows": {w: b / GIB for w, b, _ in estimate.rows},
        "model": model_description(model_dir),
        "prompt_tokens": max(len(p) for p in prompt_ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "24m"], choices=list(MODELS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--model", help=argparse.SUPPRESS)  # one measurement, in a child process
    parser.add_argument("--checkpointing", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model:
        args.checkpointing = bool(args.checkpointing)
        print(json.dumps(measure(args)))
        return
    if args.smoke:
        args.models, args.prompts, args.samples, args.micro_batch, args.response_tokens = ["tiny"], 2, 2, 4, 32
    print(f"$ {command_line()}")
    print(
        f"rollout batch {args.prompts} prompts x {args.samples} samples, micro-batch {args.micro_batch}, "
        f"{args.response_tokens} response tokens, PPO (critic + reference), float32, CPU"
    )
    worst = 0.0
    for model in args.models:
        for checkpointing in (False, True):
            child = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--model", model, "--checkpointing", str(int(checkpointing))],
                cwd=ROOT / "bench",
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)},
            )
            if child.returncode != 0:
                print(f"{model}: failed\n{child.stderr[-3000:]}")
                continue
            r = json.loads(child.stdout.strip().splitlines()[-1])
            error = r["estimated_gib"] / r["measured_gib"] - 1
            worst = max(worst, abs(error))
            parts = ", ".join(f"{w} {v:.3f}" for w, v in r["rows"].items() if not w.startswith("vLLM") and v > 0)
            print(
                f"{model:>5} checkpointing={'on ' if checkpointing else 'off'}: measured {r['measured_gib']:.3f} GiB, "
                f"estimated {r['estimated_gib']:.3f} GiB ({error:+.0%})   [{r['model']}; prompt width {r['prompt_tokens']}]"
            )
            print(f"      estimate rows (GiB): {parts}")
    print(f"largest deviation: {worst:.0%} (goal: within 30%)")


if __name__ == "__main__":
    main()
