"""Weight sync: seconds to push the actor into vLLM, and its share of a rollout step.

A real run (GRPO preset, no KL) gives the rollout step's phase timings (module.history `timing/*`,
weight sync included); then the trained module pushes its actor into the same engine `--syncs` more
times, timed alone (PPOModule.sync_weights, i.e. VLLMEngine.sync_weights after wake_up).

    .venv/bin/python bench/weight_sync.py            # the measurement
    .venv/bin/python bench/weight_sync.py --smoke    # checks that it runs
"""

from __future__ import annotations

import argparse
import time

from common import (
    CACHE,
    add_common_args,
    arithmetic_prompt_file,
    bench_model_dir,
    build_run,
    command_line,
    engine_max_model_len,
    fmt,
    grpo_for,
    model_description,
    print_header,
    start_engine,
    stats,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout-batch-size", type=int, default=16, help="prompts per rollout step")
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--train-batch-size", type=int, default=32, help="samples per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward")
    parser.add_argument("--response-tokens", type=int, default=64, help="tokens per response (fixed)")
    parser.add_argument("--steps", type=int, default=4, help="rollout steps of the run; the first is warm-up")
    parser.add_argument("--syncs", type=int, default=10, help="timed weight syncs after the run")
    add_common_args(parser, repeats=1)
    args = parser.parse_args()
    if args.smoke:
        args.rollout_batch_size, args.samples_per_prompt, args.train_batch_size, args.micro_batch_size = 2, 2, 4, 2
        args.response_tokens, args.steps, args.syncs = 16, 2, 3

    model_dir = bench_model_dir(args)
    N = args.rollout_batch_size * args.samples_per_prompt
    print_header(
        "weight sync: actor -> vLLM, and its share of a rollout step",
        args,
        model=model_description(model_dir),
        run=f"{args.rollout_batch_size} prompts x {args.samples_per_prompt} samples = {N} samples x "
        f"{args.response_tokens} tokens, train_batch_size={args.train_batch_size}, "
        f"micro_batch_size={args.micro_batch_size}, {args.steps} rollout steps x {args.repeats} "
        f"run(s) (first step of each is warm-up), then {args.syncs} timed syncs",
    )
    engine = start_engine(model_dir, engine_max_model_len(args.response_tokens), seed=args.seed)
    ppo = grpo_for(args)
    prompt_file = arithmetic_prompt_file(max(256, args.rollout_batch_size * args.steps), args.seed)
    rows, syncs = [], []
    for rep in range(args.repeats):
        trainer, module, datamodule, plan = build_run(
            model_dir,
            prompt_file,
            ppo,
            max_response_tokens=args.response_tokens,
            total_rollout_steps=args.steps,
            engine=engine,
            out_dir=CACHE / "weight_sync-run",
            seed=args.seed,
        )
        trainer.fit(module, datamodule=datamodule)
        rows += module.history[1:]
        for _ in range(args.syncs):
            started = time.perf_counter()
            module.sync_weights(engine)
            syncs.append(time.perf_counter() - started)

    megabytes = sum(t.numel() * t.element_size() for t in module.actor.state_dict().values()) / 1e6
    in_run = stats([r["timing/weight_sync_s"] for r in rows])
    step = stats([r["timing/rollout_step_s"] for r in rows])
    alone = stats(syncs)
    print("-" * 100)
    print(f"actor state dict   : {megabytes:.1f} MB ({len(module.actor.state_dict())} tensors)")
    print(f"sync, timed alone  : {fmt(alone)}  ({megabytes / 1e3 / alone['median']:.2f} GB/s)")
    print(f"sync, inside steps : {fmt(in_run)}")
    print(f"rollout step       : {fmt(step)}")
    phases = {
        k.removeprefix("timing/").removesuffix("_s"): stats([r[k] for r in rows])["median"]
        for k in rows[0]
        if k.startswith("timing/") and k != "timing/rollout_step_s"
    }
    print("phases (median s) : " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    shares = stats([r["timing/weight_sync_s"] / r["timing/rollout_step_s"] for r in rows])
    print(
        f"sync share of a rollout step: {100 * shares['median']:.2f} % (median over {shares['n']} steps; "
        f"{100 * shares['min']:.2f}-{100 * shares['max']:.2f} %); goal <= 2 %: {'met' if shares['median'] <= 0.02 else 'not met'}"
    )
    print(f"command : {command_line()}")
    engine.close()


if __name__ == "__main__":
    main()
