"""What bf16 costs on a CPU without native bf16: one forward + backward of the 24 M bench model, float32 against
bf16 autocast (what Hugging Face's Trainer, and so TRL's GRPOTrainer, runs with `bf16=True` on a CPU).

    .venv/bin/python bench/cpu_bf16.py

lit-ppo's `precision: auto` resolves to bf16-mixed only where the CPU reports AVX512-BF16 or AMX
(lit_ppo/precision.py); this shows what the other choice would cost on a machine without them.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_common_args, bench_model_dir, command_line, stats

from lit_ppo.precision import cpu_has_native_bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=80)
    add_common_args(parser, repeats=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bench_model_dir(args), dtype=torch.float32)
    ids = torch.randint(4, 120, (args.sequences, args.tokens))
    print(f"$ {command_line()}")
    print(f"CPU reports native bf16 (AVX512-BF16 or AMX): {cpu_has_native_bf16()}")
    seconds: dict[str, list[float]] = {"float32": [], "bf16 autocast": []}
    for _ in range(1 if args.smoke else args.repeats):
        for name in seconds:  # alternating
            context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=name != "float32")
            started = time.perf_counter()
            with context:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad()
            seconds[name].append(time.perf_counter() - started)
    median = {name: stats(values)["median"] for name, values in seconds.items()}
    for name, value in median.items():
        print(f"{name:>14}: forward + backward of {args.sequences} x {args.tokens} tokens, median {value:.2f} s")
    ratio = median["bf16 autocast"] / median["float32"]
    print(f"bf16 autocast / float32: {ratio:.1f}x")


if __name__ == "__main__":
    main()
