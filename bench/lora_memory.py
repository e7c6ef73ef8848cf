"""Training-phase memory of LoRA RL against full fine-tuning at the Qwen2.5-0.5B shape, measured on the CPU and beside
`mode=plan`'s estimate (issue 25: LoRA at most half of full; the estimate within 30 % of the measured).

The model is the Qwen2.5-0.5B shape with random weights (494 M parameters, 151,936 vocabulary, bench/common's
`qwen05b_model_dir`). Both runs are `+experiment=qwen0.5b` composed by Hydra (GRPO with the recipe's k3 KL, so a
reference model; micro-batches of 8; gradient checkpointing, model=qwen's default; packing as the preset leaves it)
at `strategy.precision=auto` on the CPU, the batch made small (below), once with full-parameter training and once
with `model.lora.rank=16` (the project's default target modules, `all-linear`). Each runs in its own fresh process,
built by the product's `build_run` (bench/common.run_from_config), on one fixed rollout batch served at every rollout
step (lit_ppo.testing's FixedBatchDataModule; the NullEngine stands in for vLLM and holds nothing), for 2 rollout
steps: the first allocates AdamW's states, the second trains beside them.

What is counted, from the process's resident memory (Linux /proc/self/status; the peak is VmHWM, reset through
/proc/self/clear_refs):
- `before models`: VmRSS once Python, torch, Lightning, transformers and peft are imported, before any model loads;
- `models loaded`: VmRSS after `build_run` (actor, reference or adapters; after gc and malloc_trim, so the
  loading's freed buffers are not counted as the models);
- `peak, rollout step k`: VmHWM from the start of rollout step k to its end (reset at each step's start: the
  experience's forwards, the updates, the no-op weight sync);
- `training phase` = the larger step peak - `before models`: what the run holds at its peak above the bare process
  (weights, gradients, AdamW states, autocast's copies, activations, logits, and the allocator's slack), the quantity
  `lit_ppo.memory.estimate_memory`'s `training phase` estimates (the product's own estimate for the same config and
  plan: `lit_ppo.run.report.memory_estimate`, what plan.json records). The estimate's vLLM rows are left out (no
  engine here).

    .venv/bin/python bench/lora_memory.py             # the measurement (about 10 minutes on 2 CPU cores)
    .venv/bin/python bench/lora_memory.py --smoke     # checks that it runs (tiny model, seconds)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
from pathlib import Path

import lightning as L
from common import (
    CACHE,
    arithmetic_prompt_file,
    compose_run_config,
    model_description,
    print_header,
    print_result,
    qwen05b_model_dir,
    run_from_config,
    run_worker,
)

from lit_ppo.batch import RolloutBatch
from lit_ppo.memory import GIB
from lit_ppo.precision import cpu_has_native_bf16, resolve_precision
from lit_ppo.testing import FixedBatchDataModule, NullEngine, random_rollout_batch

MIB = 1024**2
STATUS = Path("/proc/self/status")


# ---------------------------------------------------------------- resident memory (Linux)


def status_bytes(field: str) -> int:
    """A memory field of this process's /proc/self/status (VmRSS, VmHWM, RssFile), in bytes."""
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{STATUS} has no {field} line")


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux >= 4.0), so that the next VmHWM is the peak from now on."""
    Path("/proc/self/clear_refs").write_text("5")


def release_freed_memory() -> None:
    """Python's garbage, then glibc's freed heap pages back to the system."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class StepPeaks(L.Callback):
    """The peak resident memory of each rollout step (VmHWM, reset at the step's start)."""

    def __init__(self):
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        reset_peak()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if module.rollout_step > len(self.peaks):  # the call that ends the stream adds no step
            self.peaks.append(status_bytes("VmHWM"))


# ---------------------------------------------------------------- one run (a worker process)


def run_overrides(args, model_dir: Path, lora_rank: int) -> list[str]:
    """The Hydra overrides of the measured run: the 0.5B experiment, on this CPU, at the benchmark's batch."""
    return [
        "+experiment=qwen0.5b",
        f"model.path={model_dir}",
        f"model.lora.rank={lora_rank}",
        "strategy.accelerator=cpu",
        "strategy.precision=auto",
        "strategy.device_memory_gib=null",
        f"ppo.rollout_batch_size={args.prompts}",
        f"ppo.n_samples_per_prompt={args.samples_per_prompt}",
        f"ppo.train_batch_size={args.prompts * args.samples_per_prompt}",
        *([f"ppo.micro_train_batch_size={args.micro_batch_size}"] if args.micro_batch_size else []),
        f"data.max_prompt_length={args.max_prompt_tokens}",
        "data.chat_template=false",
        f"rollout.max_response_tokens={args.response_tokens}",
        f"rollout.max_model_len={args.max_prompt_tokens + args.response_tokens}",
        f"trainer.total_rollout_steps={args.steps}",
        "trainer.eval_every=0",
        f"seed={args.seed}",
    ]


def fixed_rollout_batch(args, vocab: range) -> RolloutBatch:
    """`--prompts` random prompts of `--min-prompt-tokens` to `--max-prompt-tokens` ids (the first one the longest,
    so a micro-batch reaches the estimate's width), `--samples-per-prompt` responses each, every one running to the
    response limit (truncated), random 0/1 rewards (`lit_ppo.testing.random_rollout_batch`)."""
    rng = random.Random(args.seed)
    lengths = [args.max_prompt_tokens] + [
        rng.randint(args.min_prompt_tokens, args.max_prompt_tokens) for _ in range(args.prompts - 1)
    ]
    prompts = [[rng.randrange(vocab.start, vocab.stop) for _ in range(n)] for n in lengths]
    return random_rollout_batch(prompts, args.samples_per_prompt, args.response_tokens, vocab, args.seed)


def measure(args, model_dir: Path, lora_rank: int) -> dict:
    """One run's resident memory (see the module docstring) and the product's estimate for it."""
    import peft  # noqa: F401  what the LoRA run imports while loading: part of the bare process, not of the models
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoTokenizer

    from lit_ppo.run.report import memory_estimate

    config = compose_run_config(*run_overrides(args, model_dir, lora_rank))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = fixed_rollout_batch(args, range(4, len(tokenizer)))  # ids 0-3 are special tokens
    release_freed_memory()
    before_models = status_bytes("VmRSS")
    peaks = StepPeaks()
    trainer, module, datamodule, plan = run_from_config(
        config,
        model_dir,
        arithmetic_prompt_file(64, args.seed),  # counted by the plan; the fixed batch is what trains
        engine=NullEngine(),
        out_dir=CACHE / f"lora_memory-{'lora' if lora_rank else 'full'}",
        callbacks=[peaks],
        datamodule_class=FixedBatchDataModule,
    )
    datamodule.fixed_batch = batch
    release_freed_memory()
    models_loaded = status_bytes("VmRSS")
    models_file_backed = status_bytes("RssFile")  # mapped files (libraries; weights left mapped from safetensors)
    trainer.fit(module, datamodule=datamodule)
    if len(peaks.peaks) != args.steps:
        raise SystemExit(f"the run took {len(peaks.peaks)} rollout steps, expected {args.steps}")
    estimate = memory_estimate(config, plan)
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {
        "precision": plan.models.precision,
        "packing": plan.layout.packing,
        "micro_batch_size": plan.layout.micro_train_batch_size,
        "gradient_checkpointing": config.model.gradient_checkpointing,
        "reference": plan.models.reference_enabled,
        "target_modules": str(config.model.lora.target_modules),
        "trained_parameters": trained,
        "optimizer_steps": module.actor_optimizer_steps,
        "before_models": before_models,
        "models_loaded": models_loaded,
        "models_file_backed": models_file_backed,
        "step_peaks": peaks.peaks,
        "estimate_training": estimate.training_bytes,
        "estimate_rows": [
            (what, size, how) for what, size, how in estimate.rows if not what.startswith(("vLLM", "HF generate"))
        ],
    }


# ---------------------------------------------------------------- the comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts in the fixed rollout batch")
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--min-prompt-tokens", type=int, default=100)
    parser.add_argument("--max-prompt-tokens", type=int, default=300, help="also data.max_prompt_length")
    parser.add_argument("--response-tokens", type=int, default=256, help="every response's length (the limit)")
    parser.add_argument(
        "--micro-batch-size", type=int, default=None, help="ppo.micro_train_batch_size (default: the experiment's 8)"
    )
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="rollout steps of each run (the first allocates AdamW)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model (4,096 vocabulary) and batch: checks that the script runs; measures nothing",
    )
    parser.add_argument("--worker", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not STATUS.exists():
        raise SystemExit(f"{STATUS} is missing: this benchmark reads Linux's per-process memory; fix: run it on Linux")
    if args.smoke:
        args.prompts, args.samples_per_prompt, args.micro_batch_size = 2, 2, 2
        args.min_prompt_tokens, args.max_prompt_tokens, args.response_tokens = 8, 16, 16
    model_dir = qwen05b_model_dir(args.seed, smoke=args.smoke)
    if args.worker:
        print_result(measure(args, model_dir, args.lora_rank if args.worker == "lora" else 0))
        return

    N = args.prompts * args.samples_per_prompt
    print_header(
        "training-phase memory: LoRA against full fine-tuning (CPU resident memory) and mode=plan's estimate",
        args,
        model=model_description(model_dir),
        cpu_bf16=f"native bf16: {'yes' if cpu_has_native_bf16() else 'no'} (AVX512-BF16 or AMX); precision auto -> "
        f"{resolve_precision('auto', 'cpu')}",
        batch=f"{args.prompts} prompts of {args.min_prompt_tokens}-{args.max_prompt_tokens} tokens x "
        f"{args.samples_per_prompt} samples = {N} samples, every response {args.response_tokens} tokens; one "
        f"optimizer step of {N} samples per rollout step; {args.steps} rollout steps per run",
        runs=f"+experiment=qwen0.5b on the CPU; full fine-tuning, then model.lora.rank={args.lora_rank}; each in "
        "its own process",
    )
    logs = CACHE / "lora_memory-logs"
    results = {}
    for name in ("full", "lora"):
        results[name] = run_worker(__file__, ["--worker", name], logs / f"{name}.log", f"{name} run")
        print(f"{name} run done (its log: {logs / f'{name}.log'})", flush=True)
    report(args, results)


def report(args, results: dict[str, dict]) -> None:
    full, lora = results["full"], results["lora"]
    print("-" * 100)
    for name, r in results.items():
        print(
            f"{name}: precision {r['precision']}, packing {'on' if r['packing'] else 'off'}, micro-batches of "
            f"{r['micro_batch_size']}, gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}, "
            f"reference {'on' if r['reference'] else 'off'}"
            + (f", LoRA target modules {r['target_modules']}" if name == "lora" else "")
            + f"; {r['trained_parameters'] / 1e6:,.1f} M trained parameters, {r['optimizer_steps']} optimizer steps"
        )

    def training(r: dict) -> int:
        return max(r["step_peaks"]) - r["before_models"]

    def mib(b: int) -> str:
        return f"{b / MIB:,.0f} MiB"

    label = f"LoRA r{args.lora_rank}"
    rows = [
        ("resident, before models", lambda r: mib(r["before_models"])),
        ("resident, models loaded", lambda r: mib(r["models_loaded"])),
        ("  of which file-backed (RssFile)", lambda r: mib(r["models_file_backed"])),
        *[
            (f"peak, rollout step {k + 1}", lambda r, k=k: mib(r["step_peaks"][k]))
            for k in range(len(full["step_peaks"]))
        ],
        ("models (loaded - before)", lambda r: mib(r["models_loaded"] - r["before_models"])),
        ("training adds (peak - loaded)", lambda r: mib(max(r["step_peaks"]) - r["models_loaded"])),
        ("TRAINING PHASE (peak - before)", lambda r: mib(training(r))),
        ("estimate, training phase", lambda r: mib(r["estimate_training"])),
        ("estimate vs measured", lambda r: f"{r['estimate_training'] / training(r) - 1:+.1%}"),
    ]
    print(f"{'':<32}{'full':>16}{label:>16}")
    for what, cell in rows:
        print(f"{what:<32}{cell(full):>16}{cell(lora):>16}")
    print("estimate's rows (training phase; lit_ppo.memory.estimate_memory):")
    for name, r in results.items():
        for what, size, how in r["estimate_rows"]:
            print(f"  {name:<5} {what:<30} {size / GIB:>7.3f} GiB  {how}")
    ratio = training(lora) / training(full)
    worst = max(abs(r["estimate_training"] / training(r) - 1) for r in results.values())
    print("-" * 100)
    print(f"training phase: full {mib(training(full))}, {label} {mib(training(lora))}")
    print(f"LoRA / full: {ratio:.3f} (goal <= 0.5: {'met' if ratio <= 0.5 else 'not met'})")
    print(
        f"estimate vs measured: full {full['estimate_training'] / training(full) - 1:+.1%}, LoRA "
        f"{lora['estimate_training'] / training(lora) - 1:+.1%} (goal within 30 %: {'met' if worst <= 0.3 else 'not met'})"
    )


if __name__ == "__main__":
    main()
