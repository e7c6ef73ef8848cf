"""The whole loop on one GPU (issue 28, Part 2.1): GRPO with `rollout.engine=hf` on a Qwen2.5-1.5B-shaped model.

The run is `python train.py +experiment=qwen1.5b` (the SimpleRL-Zoo recipe: GRPO, k3 KL loss so a reference model,
math-verify reward, chat template, bf16-mixed, gradient checkpointing, packing) with the model, the data and the
batch made to fit a short GPU lease:
- model: the Qwen2.5-1.5B shape (hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, tied embeddings)
  with random weights and `lit_ppo.demo.tiny.build_char_tokenizer(151936)`: a locally built tokenizer of Qwen2.5's
  vocabulary size (characters, then word tokens ` w0`, ` w1`, ... so that every sampled id decodes);
- prompts: GSM8K-length, 100-300 characters (= tokens) of notes and an `a+b` question, plus the chat template;
- responses: up to 512 tokens (`rollout.max_response_tokens=512`); a random-weight model rarely samples
  end-of-sequence, so nearly every response runs to the limit, the costliest case;
- batch: `--prompts` prompts x 8 samples per rollout step, mini-batches of a quarter of them (4 optimizer steps per
  rollout step, as the recipe), `--steps` rollout steps.

It prints, per rollout step, the seconds of each phase (metrics.csv `timing/*`: generation, reward, experience,
training, weight sync: none with engine=hf), real (prompt + response) tokens per second of the step and of the
training phase, and the device's peak memory (`perf/device_peak_memory_gib`, the CUDA allocator's peak per rollout
step) beside the plan's estimate (plan.json). The rewards are ~0 (random weights): the run measures cost, not
learning (`python train.py rollout.engine=hf` learning is tests/end_to_end/test_learning.py's `hf_engine`).

    python bench/gpu_e2e.py --out /tmp/e2e                 # on one GPU: 16 prompts x 8 samples, 5 rollout steps
    .venv/bin/python bench/gpu_e2e.py --smoke --out /tmp/e2e   # on a CPU: a tiny model and batch, checks that it runs
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from common import CACHE, ROOT, SMOKE_MODEL, ModelSize, command_line
from workload import prompt_text

from lit_ppo.demo.arithmetic import make_problems, write_jsonl

QWEN15B = ModelSize(
    hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960, max_position_embeddings=2048
)
QWEN_VOCAB = 151936
PROMPT_TOKENS = (100, 300)  # GSM8K questions are ~50-250 Qwen tokens; with the chat template about this
SAMPLES_PER_PROMPT = 8


def model_dir(smoke: bool, seed: int = 0) -> Path:
    """The Qwen2.5-1.5B-shaped model (smoke: a 0.1 M-parameter one with a 4,096 vocabulary) with random weights and the
    character tokenizer filled to its vocabulary, saved in bfloat16 (the trainer loads float32 master weights from it);
    built once (on the GPU where there is one: random initialization of 1.5 B parameters is quicker there)."""
    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    size, vocab = (replace(SMOKE_MODEL, max_position_embeddings=2048), 4096) if smoke else (QWEN15B, QWEN_VOCAB)
    path = CACHE / f"gpu-e2e-{'smoke' if smoke else 'qwen1.5b'}-{seed}"
    if not (path / "config.json").exists():
        tokenizer = build_char_tokenizer(vocab)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = build_tiny_model(tokenizer, seed=seed, **asdict(size))
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_model_dir(model.to("cpu", torch.bfloat16), tokenizer, tmp)
        tmp.rename(path)
    return path


def prompt_file(n_prompts: int, seed: int = 0) -> Path:
    """JSONL records {question, gt_answer} (the recipe's keys): notes, then `Question: a+b=`, 100-300 characters."""
    path = CACHE / f"gpu-e2e-prompts-{n_prompts}-{seed}.jsonl"
    if not path.exists():
        problems, _ = make_problems(seed=seed, max_operand=49, n_train=n_prompts, n_eval=0)
        rng = random.Random(seed)
        records = [
            {"question": prompt_text(rng, problem["prompt"], PROMPT_TOKENS), "gt_answer": problem["answer"]}
            for problem in problems
        ]
        write_jsonl(records, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout step (x 8 samples)")
    parser.add_argument("--steps", type=int, default=5, help="rollout steps")
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, required=True, help="where the run directory's metrics, plan and log go")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and batch on the CPU; measures nothing")
    parser.add_argument("--report-only", action="store_true", help="print the report of the last run's directory")
    args = parser.parse_args()
    if args.report_only:
        return report(CACHE / "gpu-e2e-run", float("nan"), float("nan"), torch.cuda.is_available() and not args.smoke)
    if args.smoke:
        args.prompts, args.steps, args.response_tokens = 2, 2, 16
    cuda = torch.cuda.is_available() and not args.smoke
    started = time.perf_counter()
    model = model_dir(args.smoke)
    prompts = prompt_file(args.prompts * args.steps)
    build_s = time.perf_counter() - started
    run_dir = CACHE / "gpu-e2e-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        "+experiment=qwen1.5b",
        f"model.path={model}",
        f"data.path={prompts}",
        "data.eval_path=null",
        f"data.max_prompt_length={PROMPT_TOKENS[1] + 64}",
        "rollout.engine=hf",
        f"rollout.max_response_tokens={args.response_tokens}",
        f"rollout.max_model_len={PROMPT_TOKENS[1] + 64 + args.response_tokens}",
        f"ppo.rollout_batch_size={args.prompts}",
        f"ppo.n_samples_per_prompt={SAMPLES_PER_PROMPT if not args.smoke else 2}",
        f"ppo.train_batch_size={max(1, args.prompts // 4) * (SAMPLES_PER_PROMPT if not args.smoke else 2)}",
        f"trainer.total_rollout_steps={args.steps}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        f"output_dir={run_dir}",
    ]
    if not cuda:  # the experiment is for one GPU; the smoke runs the same composition on the CPU
        # precision auto is 32-true on a CPU without native bf16, and the HF engine generates in the trainer's precision:
        # the recipe's rollout.dtype=bfloat16 follows it instead (null), whatever this CPU computes natively.
        overrides += ["strategy.accelerator=cpu", "strategy.precision=auto", "strategy.device_memory_gib=null"]
        overrides += ["rollout.dtype=null"]
        overrides += ["ppo.micro_train_batch_size=2"]
    command = [sys.executable, str(ROOT / "train.py"), *overrides]
    print(f"command: {command_line()}", flush=True)
    print("run    : " + " ".join(["python train.py", *overrides]), flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT)
    wall_s = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.csv", "plan.json", "logs/run.log"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, args.out / Path(name).name)
    if result.returncode != 0:
        raise SystemExit(f"gpu_e2e: train.py exited with {result.returncode}; its log: {args.out / 'run.log'}")
    report(run_dir, build_s, wall_s, cuda)


def report(run_dir: Path, build_s: float, wall_s: float, cuda: bool) -> None:
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout_step") and float(r["rollout_step"]) >= 1]
    rows = [r for r in rows if r.get("timing/train_s")]
    plan = json.loads((run_dir / "plan.json").read_text())
    estimate = plan.get("memory") or {}
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"device : {device}; torch {torch.__version__}; model and prompts built in {build_s:.1f} s")
    print(
        f"plan   : precision {plan['models']['precision']}, {plan['counts']['samples_per_rollout_step']} samples per rollout step"
    )
    phases = ["generate", "reward", "experience", "train", "weight_sync"]
    header = (
        ["step"]
        + [f"{p}_s" for p in phases]
        + ["step_s", "real_tok", "resp_len", "tok/s step", "tok/s train", "peak GiB"]
    )
    print(" | ".join(header))
    totals = []
    for r in rows:
        seconds = [float(r.get(f"timing/{p}_s") or 0.0) for p in phases]
        step_s = sum(seconds)
        real = float(r["perf/trained_tokens"])
        peak = r.get("perf/device_peak_memory_gib") or ""
        totals.append((step_s, real, float(r["timing/train_s"]), float(peak) if peak else None))
        cells = [r["rollout_step"]] + [f"{s:.2f}" for s in seconds]
        cells += [f"{step_s:.2f}", f"{real:.0f}", f"{float(r.get('rollout/response_length_mean') or 0):.0f}"]
        cells += [
            f"{real / step_s:.0f}",
            f"{float(r['perf/tokens_per_second']):.0f}",
            f"{float(peak):.2f}" if peak else "-",
        ]
        print(" | ".join(cells))
    steady = totals[1:] or totals
    step_s = sorted(t[0] for t in steady)[len(steady) // 2]
    print(f"median rollout step after the first: {step_s:.2f} s; real tokens/s of the whole step "
          f"{sum(t[1] for t in steady) / sum(t[0] for t in steady):.0f}, of the training phase "
          f"{sum(t[1] for t in steady) / sum(t[2] for t in steady):.0f}")  # fmt: skip
    peaks = [t[3] for t in totals if t[3] is not None]
    if peaks:
        print(f"peak device memory: {max(peaks):.2f} GiB measured (max over the steps); plan's estimate: "
              f"peak {estimate.get('peak_gib')} GiB, training {estimate.get('training_gib')} GiB, rollout "
              f"{estimate.get('rollout_gib')} GiB; measured / estimated peak {max(peaks) / estimate['peak_gib']:.2f}"
              if estimate.get("peak_gib") else f"peak device memory: {max(peaks):.2f} GiB (no estimate in plan.json)")  # fmt: skip
    print(f"wall: {wall_s:.1f} s for train.py (start, load, {len(rows)} rollout steps, final checkpoint and save)")


if __name__ == "__main__":
    main()
