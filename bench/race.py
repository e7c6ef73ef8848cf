"""Time to accuracy: lit-ppo's GRPO and TRL's GRPOTrainer from the same warm-started model on the arithmetic task.

Both start from the model `make train` starts from (the tiny model after the product's cached supervised warm start)
and train on its a+b= prompts with the integer_match reward. Every few rollout steps the clock stops and the same
evaluator (Hugging Face greedy decoding of a float32 copy of the weights, this file's `GreedyAccuracy`) scores the
policy on the 200 held-out prompts; the x axis is training wall-clock seconds without those evaluations. Start-up
(process start to the first evaluation: imports, models, vLLM's engine and its warm-up) is reported apart.

- lit-ppo: `python train.py ppo=grpo` as the product composes it (Hydra: every default, precision auto), run through
  the product's `build_run` with this file's evaluator as a callback.
- TRL: `GRPOConfig()` defaults (bf16 where the config says so, loss_type, optimizer, linear schedule, beta=0, ...)
  with only what defines the task taken from lit-ppo's run: learning rate, prompts per generation round, samples per
  prompt, optimizer steps per round and the response budget (TRL's own default lr, 1e-6, is for billion-parameter
  models and moves this one nowhere in the time budget). `--trl-float32` sets bf16=False, for a CPU without native
  bf16, where TRL's default bf16 autocast runs emulated and a race would take hours (BENCHMARKS.md, "bf16 on a CPU without native bf16").

    .venv/bin/python bench/race.py              # the race; PNG, Markdown and JSON in bench/results/
    .venv/bin/python bench/race.py --smoke      # checks that it runs

Needs TRL: `make .venv/bench-installed`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

PROCESS_START = time.perf_counter()

import lightning as L  # noqa: E402
import torch  # noqa: E402
from common import (
    CACHE,
    ROOT,
    add_common_args,
    command_line,
    compose_run_config,
    phase_means,
    print_header,
    print_result,
    read_jsonl,
    run_from_config,
    run_worker,
    start_engine,
)  # noqa: E402

from lit_ppo.plan import compute_plan  # noqa: E402
from lit_ppo.rewards import integer_match  # noqa: E402

FRAMEWORKS = ("lit-ppo", "trl")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout-steps", type=int, default=30, help="rollout steps (generation rounds) per run")
    parser.add_argument("--eval-every", type=int, default=2, help="rollout steps between evaluations")
    parser.add_argument("--target", type=float, default=0.8, help="held-out greedy accuracy to reach")
    parser.add_argument(
        "--trl-float32",
        action="store_true",
        help="TRL's defaults except bf16=False: on a CPU without native bf16 (no AVX512-BF16 or AMX) TRL's default "
        "bf16 autocast runs its matrix products emulated, 30-180x slower (BENCHMARKS.md, 'bf16 on a CPU without native bf16')",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the PNG/MD/JSON go")
    parser.add_argument("--worker", choices=FRAMEWORKS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", type=Path, default=None, help=argparse.SUPPRESS)
    add_common_args(parser, repeats=1)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rollout_steps, args.eval_every = 2, 1
    return args


def compose(args):
    """The product's settings for `python train.py ppo=grpo` (smoke: a small model and warm start)."""
    overrides = ["ppo=grpo", f"trainer.total_rollout_steps={args.rollout_steps}", f"seed={args.seed}"]
    if args.smoke:
        overrides += ["model.tiny.num_layers=1", "model.warm_start.steps=2"]
        overrides += ["ppo.rollout_batch_size=4", "ppo.train_batch_size=8", "ppo.micro_train_batch_size=4"]
    return compose_run_config(*overrides)


def prepare(args, cfg, work_dir: Path) -> tuple[str, Path, Path]:
    """(warm-started model directory, train prompts, eval prompts): the product's own, cached like make train's."""
    from lit_ppo.run.train import prepare_data, prepare_model

    train_path, eval_path, train_records = prepare_data(cfg.data, work_dir)
    return prepare_model(cfg, train_records), train_path, eval_path


class GreedyAccuracy:
    """Share of `records` whose greedy response (Hugging Face generate, float32, no sampling) is the answer.

    The same evaluator for both frameworks: it copies the trained weights into its own float32 model before each
    evaluation, since a model Accelerate prepared for mixed precision (TRL's) runs every forward under bf16 autocast
    whatever the caller asks."""

    def __init__(self, model_dir: str, records: list[dict], max_new_tokens: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.records, self.max_new_tokens = records, max_new_tokens

    def __call__(self, trained) -> float:
        with torch.no_grad():
            self.model.load_state_dict(trained.state_dict())
        return greedy_accuracy(self.model, self.tokenizer, self.records, self.max_new_tokens)


def greedy_accuracy(model, tokenizer, records: list[dict], max_new_tokens: int) -> float:
    """Share of `records` whose greedy response (Hugging Face generate, no sampling) is the answer."""
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    prompts = [r["prompt"] for r in records]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    with torch.no_grad(), torch.autocast(model.device.type, enabled=False):
        out = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, encoded.input_ids.shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    scores = integer_match(prompts, texts, [r["answer"] for r in records], [{}] * len(records))
    return sum(scores) / len(scores)


class RaceClock:
    """Training seconds with the evaluations cut out, and the (rollout step, seconds, accuracy) points."""

    def __init__(self, evaluate):
        self.evaluate = evaluate
        self.seconds = 0.0
        self.resumed: float | None = None
        self.points: list[dict] = []
        self.startup_seconds = 0.0  # process start to the first evaluation (models, engine, data)

    def point(self, rollout_step: int, model) -> None:
        if self.resumed is None:
            self.startup_seconds = time.perf_counter() - PROCESS_START
        else:
            self.seconds += time.perf_counter() - self.resumed
        accuracy = self.evaluate(model)
        self.points.append({"rollout_step": rollout_step, "train_seconds": self.seconds, "accuracy": accuracy})
        print(f"  rollout step {rollout_step}: {self.seconds:.1f} s, accuracy {accuracy:.3f}", file=sys.stderr)
        self.resumed = time.perf_counter()


# ---------------------------------------------------------------- workers (one framework per process)


def run_litppo(args, cfg, model_dir: str, train_path: Path, eval_records: list[dict], work_dir: Path) -> dict:
    ppo, rollout = cfg.ppo, cfg.rollout
    clock = RaceClock(GreedyAccuracy(model_dir, eval_records, rollout.max_response_tokens))

    class Evaluations(L.Callback):
        def on_train_start(self, trainer, module):
            clock.point(0, module.actor)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            step = module.rollout_step
            if step > clock.points[-1]["rollout_step"] and (step % args.eval_every == 0 or step == args.rollout_steps):
                clock.point(step, module.actor)

    # The product's settings whole (Hydra's composition of `ppo=grpo`); this file's evaluator replaces the run's own.
    config = replace(cfg, trainer=replace(cfg.trainer, total_rollout_steps=args.rollout_steps, eval_every=0))
    engine_dtype = compute_plan(config, len(read_jsonl(train_path))).models.rollout_dtype
    engine = start_engine(model_dir, rollout.max_model_len, seed=cfg.seed, dtype=engine_dtype, fixed_length=False)
    trainer, module, datamodule, plan = run_from_config(
        config, model_dir, train_path, engine=engine, out_dir=work_dir / "lit-ppo-run", callbacks=[Evaluations()]
    )
    trainer.fit(module, datamodule=datamodule)
    rows = module.history
    return {
        "points": clock.points,
        # Mean seconds per rollout step of each phase (evaluations are outside them), the first step apart.
        "first_step_phases": phase_means(rows[:1]),
        "phases": phase_means(rows[1:]),
        "optimizer_steps": module.actor_optimizer_steps,
        "expected_optimizer_steps": plan.counts.total_optimizer_steps,
        "precision": f"{plan.models.precision}, vLLM {plan.models.rollout_dtype}",
        "settings": f"ppo=grpo (lr {ppo.actor_lr:g}, {ppo.rollout_batch_size} prompts x {ppo.n_samples_per_prompt}, "
        f"train_batch_size {ppo.train_batch_size}, kl_coef {ppo.kl_coef:g}), max_response_tokens "
        f"{rollout.max_response_tokens}",
        "startup_seconds": clock.startup_seconds,
    }


def run_trl(args, cfg, model_dir: str, train_path: Path, eval_records: list[dict], work_dir: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    ppo = cfg.ppo
    samples = ppo.rollout_batch_size * ppo.n_samples_per_prompt
    steps_per_round = samples // ppo.train_batch_size  # lit-ppo's optimizer steps per rollout step (ppo_epochs 1)
    max_tokens = cfg.rollout.max_response_tokens
    config = GRPOConfig(
        output_dir=str(work_dir / "trl-run"),
        seed=cfg.seed,
        use_cpu=True,
        learning_rate=ppo.actor_lr,
        num_generations=ppo.n_samples_per_prompt,
        per_device_train_batch_size=ppo.train_batch_size,
        steps_per_generation=steps_per_round,
        max_completion_length=max_tokens,
        max_steps=args.rollout_steps * steps_per_round,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **({"bf16": False} if args.trl_float32 else {}),
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    clock = RaceClock(GreedyAccuracy(model_dir, eval_records, max_tokens))

    class Evaluations(TrainerCallback):
        def on_train_begin(self, train_args, state, control, model=None, **kwargs):
            clock.point(0, model)

        def on_step_end(self, train_args, state, control, model=None, **kwargs):
            if state.global_step % steps_per_round:
                return
            step = state.global_step // steps_per_round
            if step % args.eval_every == 0 or step == args.rollout_steps:
                clock.point(step, model)

    def integer_match_reward(prompts, completions, answer, **_):
        return integer_match(prompts, completions, answer, [{}] * len(prompts))

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=integer_match_reward,
        args=config,
        train_dataset=Dataset.from_list(read_jsonl(train_path)),
        processing_class=tokenizer,
        callbacks=[Evaluations()],
    )
    trainer.train()
    return {
        "points": clock.points,
        "optimizer_steps": trainer.state.global_step,
        "expected_optimizer_steps": args.rollout_steps * steps_per_round,
        "precision": "bf16 autocast" if config.bf16 else "float32",
        "settings": f"GRPOConfig defaults{' (but bf16=False)' if args.trl_float32 else ''} + lr "
        f"{config.learning_rate:g}, num_generations {config.num_generations}, "
        f"per_device_train_batch_size {config.per_device_train_batch_size}, steps_per_generation "
        f"{config.steps_per_generation}, max_completion_length {max_tokens} (loss_type {config.loss_type}, beta "
        f"{config.beta:g}, {config.lr_scheduler_type.value} schedule, optim {config.optim.value})",
        "startup_seconds": clock.startup_seconds,
    }


# ---------------------------------------------------------------- the parent


def time_to(points: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation at or above `target` (None: never reached)."""
    return next((p["train_seconds"] for p in points if p["accuracy"] >= target), None)


def plot(results: dict[str, list[dict]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for framework, runs in results.items():
        for i, run in enumerate(runs):
            xs = [p["train_seconds"] for p in run["points"]]
            ys = [p["accuracy"] for p in run["points"]]
            ax.plot(xs, ys, marker="o", markersize=3, label=framework if i == 0 else None)
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("training seconds (evaluations excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("GRPO from the same warm-started model: lit-ppo vs TRL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    cfg = compose(args)
    work_dir = args.work_dir or CACHE / "race"
    if args.worker:
        model_dir, train_path, eval_path = prepare(args, cfg, work_dir)
        run = run_litppo if args.worker == "lit-ppo" else run_trl
        result = run(args, cfg, model_dir, train_path, read_jsonl(eval_path), work_dir)
        print_result(result)
        return

    prepare(args, cfg, work_dir)  # the warm start, before anything is timed
    print_header(
        "time to accuracy: lit-ppo GRPO vs TRL GRPOTrainer",
        args,
        model=f"the default experiment's tiny model after its warm start (cache {cfg.cache_dir})",
        mapping="lit-ppo `ppo=grpo` at its defaults; TRL GRPOConfig defaults with lit-ppo's lr and batch shape"
        + (" and bf16=False" if args.trl_float32 else ""),
        runs=f"{args.repeats} repetitions x 2 frameworks, alternating which goes first; {args.rollout_steps} rollout "
        f"steps each, greedy accuracy on the held-out prompts every {args.eval_every}",
    )
    results: dict[str, list[dict]] = {f: [] for f in FRAMEWORKS}
    for rep in range(args.repeats):
        for framework in FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]:
            result = run_worker(
                __file__,
                ["--worker", framework, "--work-dir", str(work_dir)],
                work_dir / f"{framework}-{rep}.log",
                f"{framework} run",
            )
            results[framework].append(result)
            reached = time_to(result["points"], args.target)
            print(
                f"repetition {rep + 1} {framework:<8}: accuracy {result['points'][0]['accuracy']:.3f} -> "
                f"{result['points'][-1]['accuracy']:.3f} in {result['points'][-1]['train_seconds']:.1f} training s; "
                f"{args.target:g} reached at "
                f"{'never' if reached is None else f'{reached:.1f} s'}; optimizer steps {result['optimizer_steps']} "
                f"(planned {result['expected_optimizer_steps']}); startup {result['startup_seconds']:.1f} s",
                flush=True,
            )
            for label, key in (("first rollout step", "first_step_phases"), ("later steps, mean", "phases")):
                if key in result:  # lit-ppo's own timings (TRL's are not split by phase)
                    print(
                        f"  {label}: " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in result[key].items())
                    )

    stamp = datetime.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    png, md, js = (args.out / f"race_{stamp}{suffix}" for suffix in (".png", ".md", ".json"))
    plot(results, args.target, png)
    js.write_text(json.dumps({"command": command_line(), "target": args.target, "results": results}, indent=1))
    lines = [f"# Time to {args.target:g} held-out greedy accuracy (`{command_line()}`)", ""]
    for framework, runs in results.items():
        lines += [f"- {framework}: {runs[0]['settings']}; {runs[0]['precision']}"]
    lines += [
        "",
        "| framework | repetition | start | end | training s to the end | training s to target | start-up s "
        "| start-up + training s to target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for framework, runs in results.items():
        for i, run in enumerate(runs):
            points, reached, startup = run["points"], time_to(run["points"], args.target), run["startup_seconds"]
            lines.append(
                f"| {framework} | {i + 1} | {points[0]['accuracy']:.3f} | {points[-1]['accuracy']:.3f} | "
                f"{points[-1]['train_seconds']:.1f} | {'not reached' if reached is None else f'{reached:.1f}'} | "
                f"{startup:.1f} | {'not reached' if reached is None else f'{startup + reached:.1f}'} |"
            )
    lines += ["", "Every evaluation (rollout step, training seconds, accuracy):", ""]
    for framework, runs in results.items():
        for i, run in enumerate(runs):
            pts = ", ".join(
                f"{p['rollout_step']}: {p['train_seconds']:.0f} s {p['accuracy']:.2f}" for p in run["points"]
            )
            lines.append(f"- {framework} {i + 1}: {pts}")
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    reached = {f: [time_to(r["points"], args.target) for r in runs] for f, runs in results.items()}
    if all(t is not None for ts in reached.values() for t in ts):
        ratio = median(reached["lit-ppo"]) / median(reached["trl"])
        print(
            f"time to {args.target:g} (training s): lit-ppo / TRL = {ratio:.2f} (medians; goal <= 0.5: "
            f"{'met' if ratio <= 0.5 else 'not met'})"
        )
        with_startup = {
            f: median([t + r["startup_seconds"] for t, r in zip(reached[f], runs)]) for f, runs in results.items()
        }
        print(f"  with start-up: lit-ppo / TRL = {with_startup['lit-ppo'] / with_startup['trl']:.2f} (medians)")
    else:
        print(f"time to {args.target:g}: not reached by every run (see the table); no ratio")
    print(f"figure: {png}\ntable : {md}\ncommand : {command_line()}")


if __name__ == "__main__":
    main()
