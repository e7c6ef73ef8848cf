"""Weight sync: seconds and bytes to push the actor into vLLM, and its share of a rollout step.

A real run (GRPO preset, no KL) gives the rollout step's phase timings (module.history `timing/*`,
weight sync included); then the trained module pushes its actor into the same engine `--syncs` more
times, timed alone (PPOModule.sync_weights: VLLMEngine.sync_weights after wake_up, or with `--lora-rank`
VLLMEngine.sync_adapter, the adapter alone as a new adapter version). `--steps 0` skips the run (sync only).

    .venv/bin/python bench/weight_sync.py                                # full weights, 24 M bench model
    .venv/bin/python bench/weight_sync.py --lora-rank 16                 # adapter only, the same model
    .venv/bin/python bench/weight_sync.py --qwen05b --steps 0            # Qwen2.5-0.5B shape (151,936 vocab)
    .venv/bin/python bench/weight_sync.py --qwen05b --steps 0 --lora-rank 16
    .venv/bin/python bench/weight_sync.py --smoke                        # checks that it runs
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
    qwen05b_model_dir,
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
    parser.add_argument("--lora-rank", type=int, default=0, help="model.lora.rank (all-linear); 0: full weights")
    parser.add_argument("--qwen05b", action="store_true", help="the Qwen2.5-0.5B shape (151,936 vocabulary)")
    add_common_args(parser, repeats=1)
    args = parser.parse_args()
    if args.smoke:
        args.rollout_batch_size, args.samples_per_prompt, args.train_batch_size, args.micro_batch_size = 2, 2, 4, 2
        args.response_tokens, args.steps, args.syncs = 16, 2, 3

    if args.qwen05b:
        model_dir = qwen05b_model_dir(args.seed)
    else:
        model_dir = bench_model_dir(args)
    from lit_ppo.config import LoraConfig

    lora = LoraConfig(rank=args.lora_rank) if args.lora_rank else None
    N = args.rollout_batch_size * args.samples_per_prompt
    print_header(
        "weight sync: actor -> vLLM, and its share of a rollout step",
        args,
        model=model_description(model_dir),
        run=f"{args.rollout_batch_size} prompts x {args.samples_per_prompt} samples = {N} samples x "
        f"{args.response_tokens} tokens, train_batch_size={args.train_batch_size}, "
        f"micro_batch_size={args.micro_batch_size}, {args.steps} rollout steps x {args.repeats} "
        f"run(s) (first step of each is warm-up), then {args.syncs} timed syncs",
        sync=f"LoRA rank {args.lora_rank}, all-linear: the adapter alone" if lora else "full weights",
    )
    engine = start_engine(
        model_dir,
        engine_max_model_len(args.response_tokens),
        seed=args.seed,
        max_lora_rank=lora.vllm_max_lora_rank if lora else None,
    )
    ppo = grpo_for(args)
    prompt_file = arithmetic_prompt_file(max(256, args.rollout_batch_size * args.steps), args.seed)
    rows, syncs = [], []
    for rep in range(args.repeats):
        trainer, module, datamodule, plan = build_run(
            model_dir,
            prompt_file,
            ppo,
            max_response_tokens=args.response_tokens,
            total_rollout_steps=max(1, args.steps),  # --steps 0: the run is built but not fitted
            engine=engine,
            out_dir=CACHE / "weight_sync-run",
            seed=args.seed,
            lora=lora,
        )
        if args.steps:
            trainer.fit(module, datamodule=datamodule)
            rows += module.history[1:]
        for i in range(args.syncs):
            started = time.perf_counter()
            module.sync_weights(engine, version=100 * rep + i + 2)  # a new adapter version each time
            syncs.append(time.perf_counter() - started)

    megabytes = sum(t.numel() * t.element_size() for t in module.actor.state_dict().values()) / 1e6
    pushed = module.last_sync_bytes / 1e6
    alone = stats(syncs)
    print("-" * 100)
    print(f"actor state dict   : {megabytes:.1f} MB ({len(module.actor.state_dict())} tensors)")
    print(f"bytes per sync     : {pushed:.2f} MB (perf/weight_sync_bytes)")
    print(f"sync, timed alone  : {fmt(alone)}  ({pushed / 1e3 / alone['median']:.3f} GB/s)")
    if not rows:
        print(f"command : {command_line()}")
        engine.close()
        return
    in_run = stats([r["timing/weight_sync_s"] for r in rows])
    step = stats([r["timing/rollout_step_s"] for r in rows])
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
