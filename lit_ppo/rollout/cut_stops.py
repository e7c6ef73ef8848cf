"""Stop strings (rollout.stop) across a partial rollout's cut (docs/async.md, partial rollouts).

An engine matches stop strings in the text of the tokens it generates in a call only (vLLM's detokenizer:
`check_stop_strings` on the output text; the HF engine the same), not in the prompt. A carried sample's continuation
has its tokens so far in the prompt, so a stop string that begins before the cut and completes after it would not
end the sample. `stopped_across_cut` ends it there, as the engine ends a response at a stop string within one call:
the token that completes it kept, the ones after it not generated (dropped here, with their log-probs).
`text_before_stop` cuts a sample's whole decoded text before its stop string, as the engine cuts a response's."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from lit_ppo.contract import Generation


def stopped_across_cut(previous: Sequence[int], generation: Generation, stop: Sequence[str], tokenizer) -> Generation:
    """`generation` (a continuation of `previous`, the tokens before the cut) ended at the first of its tokens that
    completes a `stop` string begun before the cut; `generation` itself when none does."""
    if not stop or not previous or not generation.token_ids:
        return generation
    longest = max(len(s) for s in stop)
    tail = stop_tail(previous, longest, tokenizer)
    # Characters wholly before the cut: a cut inside a character's bytes decodes it as U+FFFD, whole once continued.
    before = len(tokenizer.decode(tail, skip_special_tokens=True).rstrip("\ufffd"))
    for k in range(1, len(generation.token_ids) + 1):
        text = tokenizer.decode(tail + list(generation.token_ids[:k]), skip_special_tokens=True)
        if any(text.find(s, max(0, before - len(s) + 1)) != -1 for s in stop):
            if k == len(generation.token_ids) and not generation.truncated:
                return generation  # the engine ended it there itself
            ids, logprobs = generation.token_ids[:k], generation.logprobs[:k]
            return replace(generation, token_ids=list(ids), logprobs=list(logprobs), truncated=False)
        if len(text) - before >= longest:  # any stop string begun before the cut would have completed by now
            break
    return generation


def stop_tail(previous: Sequence[int], longest: int, tokenizer) -> list[int]:
    """The last tokens of `previous` whose text holds a stop string of `longest` characters begun before the cut: grown
    (doubled) until it decodes to `longest` + 4 characters, so that a character of several byte tokens (byte fallback,
    a CJK character or an emoji of 2-4 tokens) and the U+FFFD of the bytes a cut splits, at either end, still leave
    the whole stop string in it; all of `previous` at most."""
    size = longest + 4
    while True:
        tail = list(previous[-size:])
        if size >= len(previous) or len(tokenizer.decode(tail, skip_special_tokens=True)) >= longest + 4:
            return tail
        size *= 2


def text_before_stop(text: str, stop: Sequence[str]) -> str:
    """`text` cut before the stop string that completes first in it (vLLM's choice), as the engine cuts a
    response's text; `text` when none is in it."""
    found = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
    return text[: min(found)[1]] if found else text
