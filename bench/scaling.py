"""Scaling: seconds per rollout step as the rollout batch and the response length double (1x, 2x, 4x).

Real runs (GRPO preset, no KL) sharing one vLLM engine in this process, as the tests do
(RolloutDataModule(engine=...)). The rollout batch sweep keeps the response length; the length sweep
keeps the rollout batch. train_batch_size and micro_batch_size stay fixed, so a 2x rollout batch means
2x the optimizer steps: the work per rollout step doubles, and linear cost means 2x the seconds.

    .venv/bin/python bench/scaling.py            # the measurement
    .venv/bin/python bench/scaling.py --smoke    # checks that it runs
"""

from __future__ import annotations

import argparse

from common import (
    CACHE,
    RolloutClock,
    add_common_args,
    arithmetic_prompt_file,
    bench_model_dir,
    build_run,
    command_line,
    engine_max_model_len,
    grpo_for,
    model_description,
    print_header,
    start_engine,
    stats,
)

FACTORS = (1, 2, 4)


def run_once(args, model_dir, prompt_file, engine, rollout_batch_size: int, response_tokens: int) -> dict:
    ppo = grpo_for(args, rollout_batch_size=rollout_batch_size)
    clock = RolloutClock()
    trainer, module, datamodule, plan = build_run(
        model_dir,
        prompt_file,
        ppo,
        max_response_tokens=response_tokens,
        total_rollout_steps=args.steps,
        engine=engine,
        out_dir=CACHE / "scaling-run",
        seed=args.seed,
        callbacks=[clock],
    )
    trainer.fit(module, datamodule=datamodule)
    rows = module.history[1:]
    return {
        "step_s": clock.steady_step_seconds(),
        "phases": {
            k.removeprefix("timing/").removesuffix("_s"): [r[k] for r in rows]
            for k in rows[0]
            if k.startswith("timing/") and k != "timing/rollout_step_s"
        },
        "optimizer_steps": plan.counts.optimizer_steps_per_rollout_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout-batch-size", type=int, default=8, help="prompts per rollout step at 1x")
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--response-tokens", type=int, default=64, help="tokens per response at 1x (fixed)")
    parser.add_argument("--train-batch-size", type=int, default=32, help="samples per optimizer step (fixed)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward (fixed)")
    parser.add_argument("--steps", type=int, default=3, help="rollout steps per run; the first is warm-up, not counted")
    add_common_args(parser, repeats=2)
    args = parser.parse_args()
    if args.smoke:
        args.rollout_batch_size, args.samples_per_prompt, args.response_tokens = 2, 2, 8
        args.train_batch_size, args.micro_batch_size, args.steps, args.repeats = 4, 2, 2, 1
    if args.steps < 2:
        raise SystemExit(f"--steps={args.steps}: need at least 2 rollout steps (the first is warm-up); fix: --steps 3")

    model_dir = bench_model_dir(args)
    R, n, T = args.rollout_batch_size, args.samples_per_prompt, args.response_tokens
    configs = (
        [("1x", R, T)]
        + [(f"batch {f}x", R * f, T) for f in FACTORS[1:]]
        + [(f"length {f}x", R, T * f) for f in FACTORS[1:]]
    )
    print_header(
        "scaling: seconds per rollout step vs rollout batch size and response length",
        args,
        model=model_description(model_dir),
        base=f"1x = {R} prompts x {n} samples x {T} tokens; train_batch_size={args.train_batch_size}, "
        f"micro_batch_size={args.micro_batch_size} (fixed); {args.steps} rollout steps per run (first is "
        f"warm-up), {args.repeats} repetitions (order reversed on odd ones), one vLLM engine for all runs",
    )
    engine = start_engine(model_dir, engine_max_model_len(T * FACTORS[-1]), seed=args.seed)
    prompt_file = arithmetic_prompt_file(max(256, R * FACTORS[-1] * args.steps), args.seed)
    results = {name: {"step_s": [], "phases": {}} for name, _, _ in configs}
    for rep in range(args.repeats):
        for name, prompts, length in configs if rep % 2 == 0 else configs[::-1]:
            r = run_once(args, model_dir, prompt_file, engine, prompts, length)
            results[name]["step_s"] += r["step_s"]
            results[name]["optimizer_steps"] = r["optimizer_steps"]
            for k, v in r["phases"].items():
                results[name]["phases"].setdefault(k, []).extend(v)
            print(f"repetition {rep + 1} {name:<10}: {stats(r['step_s'])['median']:.3f} s / rollout step", flush=True)

    base = stats(results["1x"]["step_s"])["median"]
    phase_names = list(results["1x"]["phases"])
    print("-" * 100)
    header = (
        f"{'config':<10} {'prompts':>7} {'samples':>7} {'tokens':>6} {'opt steps':>9} {'s/step':>8} {'growth':>7} "
        + " ".join(f"{p:>11}" for p in phase_names)
    )
    print(header)
    for name, prompts, length in configs:
        seconds = stats(results[name]["step_s"])["median"]
        phases = " ".join(f"{stats(results[name]['phases'][p])['median']:>11.3f}" for p in phase_names)
        print(
            f"{name:<10} {prompts:>7} {prompts * n:>7} {length:>6} {results[name]['optimizer_steps']:>9} "
            f"{seconds:>8.3f} {seconds / base:>6.2f}x {phases}"
        )
    print("(s/step: median wall-clock seconds per rollout step; phases: median seconds; growth: s/step over 1x)")
    for sweep in ("batch", "length"):
        growth = [stats(results[f"{sweep} {f}x"]["step_s"])["median"] / base for f in FACTORS[1:]]
        per_doubling = [growth[0]] + [growth[i] / growth[i - 1] for i in range(1, len(growth))]
        print(
            f"{sweep:<6} growth: 2x -> {growth[0]:.2f}x, 4x -> {growth[1]:.2f}x the seconds "
            f"(per doubling {', '.join(f'{g:.2f}' for g in per_doubling)}; linear is 2.00)"
            + (f"; goal no worse than linear: {'met' if growth[1] <= 4.0 else 'not met'}" if sweep == "batch" else "")
        )
    print(f"command : {command_line()}")
    engine.close()


if __name__ == "__main__":
    main()
