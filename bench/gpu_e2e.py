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

`--shape qwen2.5-7b` (issue 41) runs `+experiment=qwen7b_lora` instead (LoRA r32 on the frozen bf16 base, the
reference the actor with its adapter disabled) at the Qwen2.5-7B shape (hidden 3584, 28 layers, 28 heads, 4 KV heads,
intermediate 18944, an LM head of its own, vocabulary 152,064). `--mode disaggregated` runs the same with
`rollout.mode=disaggregated` and one HF-engine rollout worker (`rollout.engine=hf`, k = `--max-staleness`) sharing the
trainer's device (`rollout.workers.devices=0`): the step's generate column is then the trainer's wait for the batch,
and `timing/weight_sync_s`, `perf/weight_sync_bytes` the push of the weights through gloo (host memory) to the worker.

    python bench/gpu_e2e.py --out /tmp/e2e                 # on one GPU: 16 prompts x 8 samples, 5 rollout steps
    python bench/gpu_e2e.py --shape qwen2.5-7b --samples 4 --response-tokens 256 --steps 3 --out /tmp/e2e7b
    python bench/gpu_e2e.py --mode disaggregated --samples 4 --response-tokens 128 --steps 4 --out /tmp/async
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from common import CACHE, ROOT, SMOKE_MODEL, ModelSize, command_line
from workload import prompt_text

from lit_ppo.demo.arithmetic import make_problems, write_jsonl

QWEN15B = ModelSize(
    hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960, max_position_embeddings=2048
)
QWEN7B = ModelSize(
    hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944, max_position_embeddings=2048
)


@dataclass(frozen=True)
class Shape:
    size: ModelSize
    vocab_size: int  # Qwen2.5's config.json (padded to 64)
    tied: bool  # tie_word_embeddings
    experiment: str  # conf/experiment/<name>.yaml, the recipe for this size on one GPU


SHAPES = {
    "qwen2.5-1.5b": Shape(QWEN15B, 151936, True, "qwen1.5b"),
    "qwen2.5-7b": Shape(QWEN7B, 152064, False, "qwen7b_lora"),
}
PROMPT_TOKENS = (100, 300)  # GSM8K questions are ~50-250 Qwen tokens; with the chat template about this


def model_dir(shape: str, smoke: bool, seed: int = 0) -> Path:
    """The model of `shape` (smoke: a 0.1 M-parameter one with a 4,096 vocabulary, tied or not as the shape) with
    random weights and the character tokenizer filled to its vocabulary, saved in bfloat16 (the trainer loads float32
    master weights, or with LoRA a bf16 frozen base, from it); built once (on the GPU where there is one: random
    initialization of billions of parameters is quicker there)."""
    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    spec = SHAPES[shape]
    size, vocab = (replace(SMOKE_MODEL, max_position_embeddings=2048), 4096) if smoke else (spec.size, spec.vocab_size)
    path = CACHE / f"gpu-e2e-{shape}{'-smoke' if smoke else ''}-{seed}"
    if not (path / "config.json").exists():
        tokenizer = build_char_tokenizer(vocab)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = build_tiny_model(tokenizer, seed=seed, tie_word_embeddings=spec.tied, **asdict(size))
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_model_dir(model.to(torch.bfloat16).to("cpu"), tokenizer, tmp)
        tmp.rename(path)
        del model
        if torch.cuda.is_available():  # train.py runs in another process: leave it the device (30 GB at the 7B shape)
            torch.cuda.empty_cache()
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
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b", help="the model's shape and recipe")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--steps", type=int, default=5, help="rollout steps")
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--mode", choices=["colocated", "disaggregated"], default="colocated")
    parser.add_argument("--max-staleness", type=int, default=1, help="k of --mode disaggregated")
    parser.add_argument("--run-dir", type=Path, default=CACHE / "gpu-e2e-run", help="train.py's output_dir")
    parser.add_argument("--out", type=Path, required=True, help="where the run directory's metrics, plan and log go")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and batch on the CPU; measures nothing")
    parser.add_argument("--report-only", action="store_true", help="print the report of the last run's directory")
    args = parser.parse_args()
    if args.report_only:
        return report(args.run_dir, float("nan"), float("nan"), torch.cuda.is_available() and not args.smoke)
    if args.smoke:
        args.prompts, args.samples, args.steps, args.response_tokens = 2, 2, 2, 16
    cuda = torch.cuda.is_available() and not args.smoke
    started = time.perf_counter()
    model = model_dir(args.shape, args.smoke)
    prompts = prompt_file(args.prompts * args.steps)
    build_s = time.perf_counter() - started
    run_dir = args.run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        f"+experiment={SHAPES[args.shape].experiment}",
        f"model.path={model}",
        f"data.path={prompts}",
        "data.eval_path=null",
        f"data.max_prompt_length={PROMPT_TOKENS[1] + 64}",
        "rollout.engine=hf",
        f"rollout.max_response_tokens={args.response_tokens}",
        f"rollout.max_model_len={PROMPT_TOKENS[1] + 64 + args.response_tokens}",
        f"ppo.rollout_batch_size={args.prompts}",
        f"ppo.n_samples_per_prompt={args.samples}",
        f"ppo.train_batch_size={max(1, args.prompts // 4) * args.samples}",  # 4 optimizer steps per rollout step
        f"trainer.total_rollout_steps={args.steps}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        f"output_dir={run_dir}",
    ]
    if args.mode == "disaggregated":  # one worker on the trainer's own device (one GPU; on a CPU: its own process)
        overrides += ["rollout.mode=disaggregated", f"rollout.max_staleness={args.max_staleness}"]
        overrides += ["rollout.workers.count=1", "rollout.workers.devices=0"]
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
    for name in ("metrics.csv", "plan.json", "logs/run.log", "logs/rollout_worker0.log"):
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
    workers = plan.get("workers")
    if workers:
        print(f"workers: {workers['count']} rollout worker(s), k = {workers['max_staleness']}, "
              f"{workers['devices_per_worker']} device(s) of its own (0: the trainer's); generate_s is the trainer's "
              "wait for the batch, weight_sync_s the push")  # fmt: skip
    phases = ["generate", "reward", "experience", "train", "weight_sync"]
    header = (
        ["step"]
        + [f"{p}_s" for p in phases]
        + ["step_s", "real_tok", "resp_len", "tok/s step", "tok/s train", "peak GiB", "sync MB"]
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
            f"{float(r.get('perf/weight_sync_bytes') or 0) / 1e6:.1f}",
        ]
        print(" | ".join(cells))
    steady = totals[1:] or totals
    step_s = sorted(t[0] for t in steady)[len(steady) // 2]
    print(f"median rollout step after the first: {step_s:.2f} s; real tokens/s of the whole step "
          f"{sum(t[1] for t in steady) / sum(t[0] for t in steady):.0f}, of the training phase "
          f"{sum(t[1] for t in steady) / sum(t[2] for t in steady):.0f}")  # fmt: skip
    syncs = [(float(r.get("timing/weight_sync_s") or 0), float(r.get("perf/weight_sync_bytes") or 0)) for r in rows]
    if any(b for _, b in syncs):
        seconds = sorted(s for s, _ in syncs[1:] or syncs)[len(syncs[1:] or syncs) // 2]
        print(f"weight sync: median {seconds:.3f} s per rollout step after the first, {max(b for _, b in syncs) / 1e6:.1f} "
              f"MB pushed ({max(b for _, b in syncs) / 1e9 / max(seconds, 1e-9):.2f} GB/s)")  # fmt: skip
    peaks = [t[3] for t in totals if t[3] is not None]
    if peaks:
        print(f"peak device memory: {max(peaks):.2f} GiB measured (max over the steps); plan's estimate: "
              f"peak {estimate.get('peak_gib')} GiB, training {estimate.get('training_gib')} GiB, rollout "
              f"{estimate.get('rollout_gib')} GiB; measured / estimated peak {max(peaks) / estimate['peak_gib']:.2f}"
              if estimate.get("peak_gib") else f"peak device memory: {max(peaks):.2f} GiB (no estimate in plan.json)")  # fmt: skip
    print(f"wall: {wall_s:.1f} s for train.py (start, load, {len(rows)} rollout steps, final checkpoint and save)")


if __name__ == "__main__":
    main()
