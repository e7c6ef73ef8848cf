"""The realistic variable-length workload of bench/vs_trl.py: long prompts, and a warm-started policy whose responses
vary in length the way a reasoning model's do.

- Prompts: 60-200 tokens (uniform), a paragraph of notes and then the question `Question: a+b=` (the character
  tokenizer makes one token per character).
- Policy: the 24 M bench model after a short supervised warm start on demonstrations whose responses are some working
  and then `#### <answer>` (GSM8K's answer format), their lengths drawn log-uniformly from 8-256 tokens (8-32 in
  --smoke runs, which cut responses there). The policy learns that format and where to stop, not the sum.
  Sampled with HF `generate` at temperature 1 (32 prompts, seed 0) its responses run 10-256 tokens, mean 76, one
  prompt at a time, and 8-256, mean 83, in one left-padded batch; about 3 % are right, so most groups of 8 get no
  reward signal. How long the responses stay depends on the updates: at lr 2e-4 they shorten within a few rollout
  steps (faster under TRL's defaults than under lit-ppo's), so a timing that compares frameworks uses a small lr
  (bench/vs_trl.py --lr 1e-6, TRL's default) and reports the lengths each framework sampled.
  The warm start runs under bf16 autocast where the CPU has native bf16, so the model differs between machines.
- Reward (`hash_answer_match`): 1.0 when the integer after the last `####` is the answer, the same function for
  both frameworks.

Built once and cached in .cache/lit_ppo/bench/ (the warm start, 150 steps of 8 demonstrations, takes
minutes on 2 cores).
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import torch
from common import BENCH_MODEL, CACHE, SMOKE_MODEL, build_model_dir, read_jsonl

from lit_ppo.demo.arithmetic import make_problems, write_jsonl
from lit_ppo.demo.warmstart import cache_key, supervised_warm_start
from lit_ppo.precision import cpu_has_native_bf16

PROMPT_TOKENS = (60, 200)
RESPONSE_TOKENS = (8, 256)
WORDS = "add the ones then tens carry sum digit check so we get next keep write it first last both make one".split()
WORKING = "add the ones, then carry the tens. "
ANSWER_MARK = "####"
WARM_START = {"steps": 150, "batch_size": 8, "lr": 1e-3}
SMOKE_WARM_START = {"steps": 4, "batch_size": 4, "lr": 1e-3}
_ANSWER = re.compile(ANSWER_MARK + r"\s*(-?\d+)\s*$")


def words(rng: random.Random, n_chars: int) -> str:
    """Space-separated words from WORDS, exactly `n_chars` characters long (cut mid-word when needed)."""
    text = ""
    while len(text) < n_chars:
        text += rng.choice(WORDS) + " "
    return text[:n_chars]


def prompt_text(rng: random.Random, question: str, tokens: tuple[int, int] = PROMPT_TOKENS) -> str:
    """`Notes: ...` then the question on its own line, `tokens` characters in all (uniform; PROMPT_TOKENS by default)."""
    total = rng.randint(*tokens)
    head, tail = "Notes: ", f"\nQuestion: {question}"
    return head + words(rng, max(0, total - len(head) - len(tail))) + tail


def response_text(rng: random.Random, answer: str) -> str:
    """Working (WORKING repeated), then `#### <answer>`; its length log-uniform in RESPONSE_TOKENS (the
    end-of-sequence token adds 1). The working is a fixed sentence so that a short warm start learns the format and
    where to stop; what the timing depends on is how long the responses are."""
    low, high = RESPONSE_TOKENS
    total = round(math.exp(rng.uniform(math.log(low), math.log(high)))) - 1
    tail = f"{ANSWER_MARK} {answer}"
    n_chars = max(0, total - len(tail) - 1)
    working = (WORKING * (n_chars // len(WORKING) + 1))[:n_chars]
    return (working.rstrip() + " " if working.strip() else "") + tail


def hash_answer_match(prompts, responses, references, extras, **_) -> list[float]:
    """1.0 when the response ends with `#### <integer>` and the integer is the reference, else 0.0."""
    scores = []
    for response, reference in zip(responses, references):
        match = _ANSWER.search(response)
        scores.append(1.0 if match and reference is not None and int(match.group(1)) == int(reference) else 0.0)
    return scores


def realistic_prompt_file(n_prompts: int, seed: int = 0) -> Path:
    """A JSONL of `n_prompts` records {prompt, answer}: notes + an a+b question (0 <= a, b <= 49)."""
    path = CACHE / f"realistic-{n_prompts}-{seed}.jsonl"
    if not path.exists():
        problems, _ = make_problems(seed=seed, max_operand=49, n_train=n_prompts, n_eval=0)
        rng = random.Random(seed)
        write_jsonl([{"prompt": prompt_text(rng, p["prompt"]), "answer": p["answer"]} for p in problems], path)
    return path


def realistic_model_dir(prompt_file: Path, *, smoke: bool = False, seed: int = 0) -> Path:
    """The warm-started bench model (cached): demonstrations are this file's prompts with `response_text` answers,
    right only half of the time (the rest one too high), so the rewards of a group differ."""
    from transformers import AutoTokenizer

    base = build_model_dir(SMOKE_MODEL if smoke else BENCH_MODEL, seed)
    settings = SMOKE_WARM_START if smoke else WARM_START
    out = CACHE / f"warm-{cache_key(base.name, settings, prompt_file.name, RESPONSE_TOKENS, WORKING, seed)}"
    records = read_jsonl(prompt_file)

    def demonstration(rng: random.Random) -> tuple[str, str]:
        record = rng.choice(records)
        answer = int(record["answer"]) + (0 if rng.random() < 0.5 else 1)
        return record["prompt"], response_text(rng, str(answer))

    # bf16 autocast where the CPU computes it natively (about 2x faster here); the saved weights are float32.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_native_bf16()):
        return supervised_warm_start(
            str(base), out, demonstration, AutoTokenizer.from_pretrained(base), seed=seed, **settings
        )


def max_model_len() -> int:
    """Room for the longest prompt and the longest response."""
    return PROMPT_TOKENS[1] + RESPONSE_TOKENS[1]
