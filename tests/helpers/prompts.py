"""Prompts of the lengths users run (about 100 tokens, not the toy's 6): as token ids, and (the `long_prompt_files`
fixture in tests/conftest.py) as prompt files."""

from __future__ import annotations

import random


def long_prompts(tokenizer, count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of low..high tokens (the character tokenizer: one token per character)."""
    rng = random.Random(seed)
    words = ["apples", "cost", "each", "Janet", "buys", "how", "many", "dollars", "per", "week", "total", "and"]
    prompts = []
    for _ in range(count):
        text = ""
        target = rng.randint(low, high)
        while len(text) < target:
            text += rng.choice(words) + " "
        prompts.append(tokenizer(text[:target]).input_ids)
    return prompts


PROMPT_TOKENS = 110  # realistic length that still fits the tiny model's 128 positions with the response


class CountingTokenizer:
    """The tokenizer, with its calls and the texts of each counted."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, text, **kwargs):
        self.calls.append(1 if isinstance(text, str) else len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)
