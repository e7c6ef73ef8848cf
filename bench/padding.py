"""Padding of the training forwards' layouts on the realistic workload's lengths (bench/workload.py), without a model.

Prompt lengths: the realistic prompt file's; response lengths: drawn from a measured sample of the warm-started
policy's (--response-lengths, HF sampling at temperature 1). Each batch: 16 prompts x 8 samples, cut into
micro-batches by the product's `micro_batch_groups` (fixed size, longest first). Printed per layout: positions laid out
per real token and the padding share.

- lit-ppo (`lit_ppo.training.batching.pack`): prompts left-padded, responses right-padded: rows x (widest prompt + longest
  response) per micro-batch;
- contiguous: prompt and response together, right-padded: rows x the longest prompt + response per micro-batch;
- one padded batch (TRL): all 128 rows x (widest prompt + longest response) of the batch.

With --train-phase it times the training phase itself (`timing/train_s` of real rollout steps: a Lightning trainer fits
a PPOModule, GRPO preset without KL, on one fixed rollout batch of those lengths, random ids) padded
(ppo.packing=false) against packed (ppo.packing=true), on the same batch, alternating A B A B; the first rollout
step of each run is warm-up and not counted. Goal: packed <= 0.75 x padded.

    .venv/bin/python bench/padding.py
    .venv/bin/python bench/padding.py --train-phase              # the measurement (24 M bench model, minutes)
    .venv/bin/python bench/padding.py --train-phase --smoke      # checks that it runs
"""

from __future__ import annotations

import argparse
import random

from common import read_jsonl
from workload import realistic_prompt_file

from lit_ppo.training.batching import micro_batch_groups, padded_tokens

# Response lengths of 32 samples of the warm-started policy (HF generate, temperature 1, one prompt at a time, seed 0).
MEASURED_RESPONSE_LENGTHS = [10, 10, 11, 11, 14, 16, 16, 16, 16, 16, 24, 24, 27, 30, 32, 47, 53, 57, 67, 78, 82, 92]
MEASURED_RESPONSE_LENGTHS += [102, 108, 117, 138, 150, 173, 196, 222, 235, 256]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--response-lengths", type=int, nargs="+", default=MEASURED_RESPONSE_LENGTHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-phase", action="store_true", help="time padded vs packed training phases")
    parser.add_argument("--train-batch-size", type=int, default=64, help="--train-phase: samples per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="--train-phase: rollout steps per run, the first warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="--train-phase: runs of each layout, alternating")
    parser.add_argument("--smoke", action="store_true", help="--train-phase: tiny model and batch, measures nothing")
    parser.add_argument("--model-dir", default=None, help="--train-phase: a model directory instead of the bench model")
    args = parser.parse_args()
    if args.train_phase:
        train_phase(args)
        return
    records = read_jsonl(realistic_prompt_file(1024, 0))
    rng = random.Random(args.seed)
    positions = {"lit-ppo (left-padded prompts, right-padded responses)": 0, "contiguous, right-padded": 0}
    positions["one padded batch (TRL)"] = 0
    real = 0
    for _ in range(args.batches):
        prompts = [len(r["prompt"]) for r in rng.sample(records, args.prompts) for _ in range(args.samples_per_prompt)]
        responses = [rng.choice(args.response_lengths) for _ in prompts]
        groups = micro_batch_groups(prompts, responses, list(range(len(prompts))), max_samples=args.micro_batch_size)
        lit, contiguous, batch = positions
        positions[lit] += sum(padded_tokens(prompts, responses, g) for g in groups)
        positions[contiguous] += sum(len(g) * max(prompts[i] + responses[i] for i in g) for g in groups)
        positions[batch] += len(prompts) * (max(prompts) + max(responses))
        real += sum(prompts) + sum(responses)
    print(
        f"{args.batches} batches of {args.prompts} x {args.samples_per_prompt}, micro-batches of {args.micro_batch_size}"
    )
    for layout, n in positions.items():
        print(f"{layout:<55} {n / real:.2f} positions per real token, padding {1 - real / n:.0%}")


def train_phase(args) -> None:
    """Padded vs packed training-phase seconds per rollout step on one realistic rollout batch (see the docstring)."""
    import torch
    from common import CACHE, bench_model_dir, build_run, fmt, grpo_for, model_description, print_header, stats
    from transformers import AutoTokenizer

    from lit_ppo.rollout.prompts import load_prompts
    from lit_ppo.testing import FixedBatchDataModule, NullEngine, rollout_batch_from_ids

    if args.smoke:
        args.prompts, args.samples_per_prompt, args.train_batch_size, args.micro_batch_size = 4, 4, 8, 4
        args.steps, args.repeats = 2, 1
        args.response_lengths = [min(n, 32) for n in args.response_lengths]
    args.rollout_batch_size = args.prompts  # the names bench/common.grpo_for reads
    model_dir = bench_model_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_file = realistic_prompt_file(1024, 0)
    rng = random.Random(args.seed)
    prompt_ids = [p.prompt_ids for p in rng.sample(load_prompts(prompt_file, tokenizer).prompts, args.prompts)]
    samples = [p for p in prompt_ids for _ in range(args.samples_per_prompt)]
    g = torch.Generator().manual_seed(args.seed)
    responses = [
        torch.randint(4, len(tokenizer), (rng.choice(args.response_lengths),), generator=g).tolist() for _ in samples
    ]
    N = len(samples)
    rewards = torch.randint(0, 2, (N,), generator=g).float()
    batch = rollout_batch_from_ids(samples, responses, args.samples_per_prompt, rewards)
    real = sum(len(p) + len(r) for p, r in zip(samples, responses))
    print_header(
        "training phase: padded vs packed micro-batches (ppo.packing)",
        args,
        model=model_description(model_dir),
        batch=f"{args.prompts} prompts x {args.samples_per_prompt} samples = {N}, {real} real tokens (prompts "
        f"{min(map(len, samples))}-{max(map(len, samples))}, responses {min(map(len, responses))}-"
        f"{max(map(len, responses))}); train_batch_size={args.train_batch_size}, micro_batch_size="
        f"{args.micro_batch_size}, GRPO without KL, float32",
        runs=f"{args.repeats} repetitions x 2, alternating, {args.steps} rollout steps each (first is warm-up)",
    )
    seconds = {"padded": [], "packed": []}
    padding = {"padded": [], "packed": []}
    for rep in range(args.repeats):
        for name in ("padded", "packed") if rep % 2 == 0 else ("packed", "padded"):
            ppo = grpo_for(args, actor_lr=1e-5, packing=name == "packed")
            trainer, module, datamodule, _ = build_run(
                model_dir,
                prompt_file,
                ppo,
                max_response_tokens=max(args.response_lengths),
                max_model_len=max(map(len, samples)) + max(args.response_lengths),
                total_rollout_steps=args.steps,
                engine=NullEngine(),
                out_dir=CACHE / "padding-train-phase",
                seed=args.seed,
                datamodule_class=FixedBatchDataModule,
            )
            datamodule.fixed_batch = batch
            trainer.fit(module, datamodule=datamodule)
            steady = module.history[1:]
            seconds[name] += [r["timing/train_s"] for r in steady]
            padding[name] += [r["perf/padding_fraction"] for r in steady]
            times = ", ".join(f"{r['timing/train_s']:.2f}" for r in steady)
            rates = ", ".join(f"{r['perf/tokens_per_second']:.0f}" for r in steady)
            print(
                f"repetition {rep + 1} {name}: training phase {times} s, {rates} real tok/s, "
                f"padding {steady[-1]['perf/padding_fraction']:.1%}",
                flush=True,
            )
    print("-" * 100)
    for name in seconds:
        print(
            f"{name:<7} training phase: {fmt(stats(seconds[name]), 's / rollout step')}; padding {padding[name][-1]:.1%}"
        )
    ratio = stats(seconds["packed"])["median"] / stats(seconds["padded"])["median"]
    print(
        f"packed / padded training-phase seconds: {ratio:.2f} (medians; goal <= 0.75: {'met' if ratio <= 0.75 else 'not met'})"
    )


if __name__ == "__main__":
    main()
