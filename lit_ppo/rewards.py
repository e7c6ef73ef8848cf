"""Reward functions and the code that calls them safely.

A reward function has this signature (the `reward.fn` config entry names one by dotted path,
with `_partial_: true` so extra keyword arguments can be bound in the YAML):

    def my_reward(prompts: list[str], responses: list[str], references: list[str | None],
                  extras: list[dict]) -> list[float] | tuple[list[float], dict[str, list[float]]]

It returns one float per response, and optionally extra per-sample metrics that are logged
as `rollout/reward_<name>` means.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

_INTEGER = re.compile(r"-?\d+")


def integer_match(prompts, responses, references, extras, **_) -> list[float]:
    """1.0 when the response is exactly the reference integer (surrounding spaces allowed), else 0.0."""
    scores = []
    for response, reference in zip(responses, references):
        text = response.strip()
        scores.append(1.0 if _INTEGER.fullmatch(text) and reference is not None and int(text) == int(reference) else 0.0)
    return scores


class RewardError(RuntimeError):
    """The reward function failed or returned something unusable; the message names the sample."""


@dataclass
class RewardScorer:
    """Calls the user's reward function on a batch and enforces its contract."""

    fn: Callable[..., Any]
    on_error: str = "raise"  # raise: stop with the sample; zero: score 0 and count it
    overlong_penalty: float = 0.0  # subtracted from responses that hit the length limit
    errors: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def __call__(self, prompts: list[str], responses: list[str], references: list, extras: list[dict],
                 truncated: list[bool]) -> list[float]:
        try:
            result = self.fn(prompts, responses, references, extras)
        except Exception as batch_error:  # find the sample that fails, one by one
            result = self._score_one_by_one(prompts, responses, references, extras, batch_error)
        scores, extra_metrics = result if isinstance(result, tuple) else (result, {})
        scores = [float(s) for s in scores]
        if len(scores) != len(responses):
            raise RewardError(
                f"reward function {_name(self.fn)} returned {len(scores)} scores for {len(responses)} responses; "
                "fix: return one float per response"
            )
        for i, s in enumerate(scores):
            if not math.isfinite(s):
                raise RewardError(
                    f"reward function {_name(self.fn)} returned {s} for sample {i} (prompt {prompts[i]!r}); "
                    "fix: return finite floats"
                )
        if self.overlong_penalty:
            scores = [s - self.overlong_penalty * bool(t) for s, t in zip(scores, truncated)]
        self.metrics = {k: float(sum(v) / max(len(v), 1)) for k, v in extra_metrics.items()}
        return scores

    def _score_one_by_one(self, prompts, responses, references, extras, batch_error):
        scores = []
        for i in range(len(responses)):
            try:
                out = self.fn([prompts[i]], [responses[i]], [references[i]], [extras[i]])
                scores.append(float((out[0] if isinstance(out, tuple) else out)[0]))
            except Exception as e:
                if self.on_error != "zero":
                    raise RewardError(
                        f"reward function {_name(self.fn)} raised on sample {i} (prompt {prompts[i]!r}, "
                        f"response {responses[i]!r}): {type(e).__name__}: {e}; fix: correct the function, or set "
                        "reward.on_error=zero to score such samples 0"
                    ) from e
                self.errors += 1
                scores.append(0.0)
        if len(scores) == len(responses) and self.errors == 0:
            raise RewardError(f"reward function {_name(self.fn)} raised on the batch but not on any single sample: {batch_error}")
        return scores


def _name(fn) -> str:
    inner = getattr(fn, "func", fn)
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"
