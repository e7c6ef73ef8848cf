"""A short supervised warm start, cached: RL pipelines start from an SFT model, not from random weights.

The demonstrations come from a teacher that is right only `teacher_accuracy` of the time and
otherwise answers one too high (a systematic error, like an SFT set with a recurring mistake).
The warm-started policy therefore already produces the answer format and sometimes the right
answer, but greedily prefers the teacher's mistake; RL with a verifiable reward has to find and
reinforce the right answers. That is the gap the default experiment closes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM

from lit_ppo.atomic import atomic_path

log = logging.getLogger(__name__)


def demonstration_sampler(
    records: list[dict], *, teacher_accuracy: float, long_fraction: float = 0.0, long_pad_tokens: int = 24
) -> Callable[[random.Random], tuple[str, str]]:
    """Draws (prompt, response) from the noisy teacher; the noise is redrawn every time, so the
    policy learns the teacher's answer distribution rather than memorising one answer per prompt.
    `long_fraction` of the demonstrations (also redrawn) think first: `long_pad_tokens` spaces before the answer,
    which `integer_match` strips, a stand-in for a long reasoning trace (the heavy-tailed workload)."""

    def sample(rng: random.Random) -> tuple[str, str]:
        record = rng.choice(records)
        answer = int(record["answer"])
        response = str(answer if rng.random() < teacher_accuracy else answer + 1)
        if long_fraction and rng.random() < long_fraction:  # no draw when off: the default demonstrations as before
            response = " " * long_pad_tokens + response
        return record["prompt"], response

    return sample


def tool_demonstration_sampler(
    records: list[dict], *, tool_call_rate: float, environment, tool_use_practice: float = 0.0, guess_digits: int = 3
) -> Callable[[random.Random], tuple[str, list[tuple[str, bool]]]]:
    """Draws (prompt, segments) from a teacher that calls the calculator `tool_call_rate` of the time, and guesses
    otherwise. A call is written with the environment's own format (`environment.call_text`), its result is the
    environment's own observation (`environment.step`), then the teacher copies it. A guess keeps the answer's
    leading digits and makes up its last `guess_digits` (almost always wrong, the way a model that cannot
    multiply in its head is wrong). Segments are (text, trained): observations are context, not imitated.

    `tool_use_practice`: a further share of demonstrations that show how a call is used once made (the
    expression, reading the result) without imitating the decision to call: their `call_start` is context. So the
    warm-started policy uses the tool competently when it calls it, but decides to call it only as often as the
    teacher does (`tool_call_rate`); whether to call is what RL learns."""

    def tool_demo(prompt: str, answer: str, decide: bool) -> list[tuple[str, bool]]:
        expression = prompt.rstrip("=")
        call = environment.call_text(expression)
        environment.reset({"prompt": prompt, "reference": answer})
        observation, _, _, _ = environment.step(call)
        start = environment.call_start if call.startswith(environment.call_start) else ""
        return [(start, decide), (call[len(start) :], True), (observation, False), (answer, True)]

    def sample(rng: random.Random) -> tuple[str, list[tuple[str, bool]]]:
        record = rng.choice(records)
        prompt, answer = record["prompt"], int(record["answer"])
        draw = rng.random()
        if draw < tool_call_rate + tool_use_practice:
            return prompt, [s for s in tool_demo(prompt, record["answer"], decide=draw < tool_call_rate) if s[0]]
        scale = 10**guess_digits
        guess = answer // scale * scale + rng.randrange(scale) if answer >= scale else rng.randrange(scale)
        return prompt, [(str(guess), True)]

    return sample


def keyed_settings(settings: dict) -> dict:
    """The warm start's settings (`model.warm_start` as a dict) its cache is keyed on: without the long-tail teacher's
    while it is off, so the default warm start keeps the key it had before they existed (its cache stays valid)."""
    if settings.get("long_fraction"):
        return settings
    return {k: v for k, v in settings.items() if k not in ("long_fraction", "long_pad_tokens")}


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def supervised_warm_start(
    base_dir: str,
    out_dir: str | Path,
    sample_demo: Callable[[random.Random], tuple[str, str]],
    tokenizer,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> Path:
    """Train on (prompt, response) pairs with the loss on response tokens only; save to out_dir."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        log.info("warm start: using cached model %s", out_dir)
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))

    def encode(prompt: str, response) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, response ids, labels); a response is text, or (text, trained) segments each tokenized on
        its own, as the episode loop tokenizes each turn and observation on its own."""
        p = tokenizer(prompt, add_special_tokens=False).input_ids
        segments = [(response, True)] if isinstance(response, str) else list(response)
        ids, labels = [], []
        for text, trained in segments:
            piece = tokenizer(text, add_special_tokens=False).input_ids
            ids += piece
            labels += piece if trained else [-100] * len(piece)
        return p, ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]

    rng = random.Random(seed)
    started = time.perf_counter()
    for step in range(steps):
        batch = [encode(*sample_demo(rng)) for _ in range(batch_size)]
        width = max(len(p) + len(r) for p, r, _ in batch)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for b, (p, r, target) in enumerate(batch):
            ids[b, : len(p) + len(r)] = torch.tensor(p + r)
            labels[b, len(p) : len(p) + len(r)] = torch.tensor(target)
            attention[b, : len(p) + len(r)] = 1
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 200 == 0 or step == steps - 1:
            log.info(
                "warm start step %d/%d loss %.4f (%.0fs)", step + 1, steps, loss.item(), time.perf_counter() - started
            )
    with atomic_path(out_dir) as tmp:  # a half-written cache is never used
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir
