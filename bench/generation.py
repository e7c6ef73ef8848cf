"""Generation: vLLM (lit-ppo's engine) against Hugging Face `generate`, same prompts, same fixed length.

Both sample at temperature 1 (no top-k, no top-p) and suppress end-of-sequence until the length limit,
so each generates exactly prompts x samples x response_tokens tokens. The two alternate, several times.

    .venv/bin/python bench/generation.py            # the measurement
    .venv/bin/python bench/generation.py --smoke    # checks that it runs
"""

from __future__ import annotations

import argparse
import time

from common import (
    add_common_args,
    arithmetic_prompt_file,
    bench_model_dir,
    command_line,
    engine_max_model_len,
    fmt,
    model_description,
    print_header,
    read_jsonl,
    start_engine,
    stats,
)

from lit_ppo.contract import GenerateRequest
from lit_ppo.rollout.engine import sampling_seeds


def hf_generate(model, tokenizer, prompt_ids: list[list[int]], *, n: int, length: int, seed: int) -> list[list[int]]:
    """n samples per prompt in one batched `generate` call (as TRL does); prompts left-padded."""
    import torch

    width = max(len(p) for p in prompt_ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])  # [P, width]
    attention_mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompt_ids])[:, None]).long()
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            num_return_sequences=n,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=length,
            min_new_tokens=length,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
    return out[:, width:].tolist()  # [P*n, length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per generation call")
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--response-tokens", type=int, default=64, help="tokens generated per sample (fixed)")
    add_common_args(parser, repeats=3)
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.samples_per_prompt, args.response_tokens, args.repeats = 4, 2, 16, 1

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = bench_model_dir(args)
    threads_before = torch.get_num_threads()
    print_header(
        "generation: vLLM (lit-ppo's engine) vs Hugging Face generate",
        args,
        model=model_description(model_dir),
        sizes=f"{args.prompts} prompts x {args.samples_per_prompt} samples x {args.response_tokens} tokens "
        f"(fixed length), temperature 1, {args.repeats} repetitions, alternating",
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = read_jsonl(arithmetic_prompt_file(max(64, args.prompts)))[: args.prompts]
    prompt_ids = [tokenizer(r["prompt"]).input_ids for r in records]
    engine = start_engine(model_dir, engine_max_model_len(args.response_tokens), seed=args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if torch.get_num_threads() != threads_before:
        print(f"note: torch threads changed from {threads_before} to {torch.get_num_threads()} when vLLM started")

    n, length = args.samples_per_prompt, args.response_tokens
    tokens = len(prompt_ids) * n * length

    def run_vllm(seed: int) -> float:
        started = time.perf_counter()
        out = engine.generate(
            GenerateRequest(
                prompt_ids,
                n=n,
                temperature=1.0,
                top_p=1.0,
                max_tokens=length,
                seeds=sampling_seeds(seed, "bench", range(len(prompt_ids)), n),
            )
        )
        seconds = time.perf_counter() - started
        lengths = {len(g.token_ids) for g in out}
        assert len(out) == len(prompt_ids) * n and lengths == {length}, f"vLLM lengths {lengths}, expected {length}"
        return seconds

    def run_hf(seed: int) -> float:
        started = time.perf_counter()
        out = hf_generate(model, tokenizer, prompt_ids, n=n, length=length, seed=seed)
        seconds = time.perf_counter() - started
        assert len(out) == len(prompt_ids) * n and {len(o) for o in out} == {length}
        return seconds

    run_vllm(args.seed), run_hf(args.seed)  # warm-up, not counted
    seconds = {"vllm": [], "hf": []}
    for rep in range(args.repeats):
        order = ("vllm", "hf") if rep % 2 == 0 else ("hf", "vllm")
        for name in order:
            seconds[name].append((run_vllm if name == "vllm" else run_hf)(args.seed + 1 + rep))
        print(
            f"repetition {rep + 1}: vLLM {tokens / seconds['vllm'][-1]:8.1f} tok/s   "
            f"HF generate {tokens / seconds['hf'][-1]:8.1f} tok/s",
            flush=True,
        )

    tok_s = {k: stats([tokens / s for s in v]) for k, v in seconds.items()}
    print("-" * 100)
    print(f"generated tokens per call: {tokens}")
    print(f"vLLM        : {fmt(tok_s['vllm'], 'tok/s', 1)}")
    print(f"HF generate : {fmt(tok_s['hf'], 'tok/s', 1)}")
    print(f"vLLM / HF   : {tok_s['vllm']['median'] / tok_s['hf']['median']:.2f}x tokens per second (medians)")
    print(f"command     : {command_line()}")
    engine.close()


if __name__ == "__main__":
    main()
