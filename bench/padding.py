"""Padding of the training forwards' layouts on the realistic workload's lengths (bench/workload.py), without a model.

Prompt lengths: the realistic prompt file's; response lengths: drawn from a measured sample of the warm-started
policy's (--response-lengths, HF sampling at temperature 1). Each batch: 16 prompts x 8 samples, cut into
micro-batches by the product's `micro_batch_groups` (fixed size, longest first). Printed per layout: positions laid out
per real token and the padding share.

- lit-ppo (`lit_ppo.training.batching.pack`): prompts left-padded, responses right-padded: rows x (widest prompt + longest
  response) per micro-batch;
- contiguous: prompt and response together, right-padded: rows x the longest prompt + response per micro-batch;
- one padded batch (TRL): all 128 rows x (widest prompt + longest response) of the batch.

    .venv/bin/python bench/padding.py
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
