"""Reward functions and the code that calls them safely.

A reward function has this signature (the `reward.fn` config entry names one by dotted path,
with `_partial_: true` so extra keyword arguments can be bound in the YAML):

    def my_reward(prompts: list[str], responses: list[str], references: list[str | None],
                  extras: list[dict]) -> list[float] | tuple[list[float], dict[str, list[float]]]

`prompts` are the prompts as the model saw them (after any chat template), `references` the
reference answers (`data.answer_key`, None without one) and `extras` the `data.extra_keys` fields of
each sample's record. It returns one finite float per response, and optionally extra per-sample
metrics that are logged as `rollout/reward_<name>` means. A callable object works too (see
`SequenceClassifierReward`): leave out `_partial_` and Hydra builds it once from its arguments.
"""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from lit_ppo.algorithms import overlong_penalty
from lit_ppo.plan import ConfigError

log = logging.getLogger("lit_ppo")

_INTEGER = re.compile(r"-?\d+")
ON_ERROR = ("raise", "zero")


def integer_match(prompts, responses, references, extras, **_) -> list[float]:
    """1.0 when the response is exactly the reference integer (surrounding spaces allowed), else 0.0."""
    scores = []
    for response, reference in zip(responses, references):
        text = response.strip()
        scores.append(1.0 if _INTEGER.fullmatch(text) and reference is not None and int(text) == int(reference) else 0.0)
    return scores


class SequenceClassifierReward:
    """A local reward model: a `transformers` sequence-classification model directory scoring prompt + response.

    The score of a sample is the logit `score_index` at the last token of prompt + response; batches
    of `batch_size` texts, kept to their last `max_length` tokens when that is set."""

    def __init__(self, model_dir: str, *, batch_size: int = 8, max_length: int | None = None, score_index: int = 0,
                 device: str = "cpu", dtype: str = "float32"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not (Path(model_dir) / "config.json").exists():
            raise ConfigError(f"reward.fn.model_dir={model_dir} is not a model directory (no config.json); "
                              "fix: point it at a saved AutoModelForSequenceClassification")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.truncation_side = "left"  # the response, at the end, is what is being judged
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # finds each text's last token in a padded batch
        self.model.to(device).eval()
        if not 0 <= score_index < self.model.config.num_labels:
            raise ConfigError(f"reward.fn.score_index={score_index} but the model has {self.model.config.num_labels} labels; "
                              f"fix: use 0..{self.model.config.num_labels - 1}")
        self.batch_size, self.max_length, self.score_index, self.device = batch_size, max_length, score_index, device

    def __call__(self, prompts, responses, references, extras) -> list[float]:
        import torch

        texts = [p + r for p, r in zip(prompts, responses)]
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                       truncation=self.max_length is not None, max_length=self.max_length).to(self.device)
                logits = self.model(**batch).logits  # [B, num_labels]
                scores.extend(logits[:, self.score_index].float().tolist())
        return scores


class RewardError(RuntimeError):
    """The reward function failed or returned something unusable; the message names the sample."""


@dataclass
class RewardScorer:
    """Calls the user's reward function on a batch and enforces its contract.

    A sample whose reward raises or is not a finite number stops the run (`on_error=raise`, naming the
    sample) or scores 0 and is counted (`on_error=zero`): `errors` counts them over the run, and
    `metrics["errors"]` in the last call (logged as `rollout/reward_errors`).

    `solved` tells which samples solved their prompt (for pass@k): the reward function's own `correct`
    metric when it returns one, else a reward of at least `solved_threshold`."""

    fn: Callable[..., Any]
    on_error: str = "raise"  # raise: stop with the sample; zero: score 0 and count it
    overlong_penalty: float = 0.0  # subtracted from responses that hit the length limit
    # DAPO's soft overlong shaping (`algorithms.overlong_penalty`): off while overlong_buffer_tokens is 0
    overlong_buffer_tokens: int = 0
    overlong_penalty_factor: float = 1.0
    max_response_length: int = 0  # rollout.max_response_length, the end of the buffer
    solved_threshold: float = 1.0  # reward at which a sample counts as solved, without a `correct` metric
    errors: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # the last call's per-sample metrics, averaged
    sample_metrics: dict[str, list[float]] = field(default_factory=dict)  # the last call's, per sample

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"reward.on_error={self.on_error!r}; fix: use one of {list(ON_ERROR)}")
        if self.overlong_buffer_tokens and not 0 < self.overlong_buffer_tokens < self.max_response_length:
            raise ConfigError(
                f"reward.overlong_buffer_tokens={self.overlong_buffer_tokens} must lie in (0, rollout.max_response_length="
                f"{self.max_response_length}); fix: e.g. a quarter of max_response_length, or 0 to turn the shaping off"
            )

    @classmethod
    def from_config(cls, reward, max_response_length: int = 0) -> "RewardScorer":
        """The scorer of a `reward` config group (conf/reward/*.yaml)."""
        import hydra

        try:
            fn = hydra.utils.instantiate(reward.fn)
        except Exception as e:
            raise ConfigError(f"reward.fn: cannot build {reward.fn.get('_target_')!r}: {e}; fix: name an importable "
                              "function (with _partial_: true) or callable class by its dotted path") from e
        if not callable(fn):
            raise ConfigError(f"reward.fn built {type(fn).__name__}, which is not callable; fix: add `_partial_: true` "
                              "for a function, or name a class with __call__")
        return cls(fn=fn, on_error=reward.on_error, overlong_penalty=reward.overlong_penalty,
                   overlong_buffer_tokens=int(reward.get("overlong_buffer_tokens", 0)),
                   overlong_penalty_factor=float(reward.get("overlong_penalty_factor", 1.0)),
                   max_response_length=max_response_length, solved_threshold=float(reward.get("solved_threshold", 1.0)))

    def __call__(self, prompts: list[str], responses: list[str], references: list, extras: list[dict],
                 truncated: list[bool], lengths: list[int] | None = None) -> list[float]:
        """Scores of the responses; `lengths` (tokens per response) are needed for the overlong shaping."""
        errors_before = self.errors
        try:
            result = self.fn(prompts, responses, references, extras)
        except Exception as batch_error:  # find the sample that fails, one by one
            scores, extra_metrics = self._score_one_by_one(prompts, responses, references, extras, batch_error)
        else:
            scores, extra_metrics = self._unpack(result, len(responses))
        for i, score in enumerate(scores):
            if not _is_finite_number(score):
                self._sample_failed(i, prompts, responses, ValueError(f"returned {score!r}, not a finite number"))
                scores[i] = 0.0
        scores = [float(s) - self.overlong_penalty * bool(t) for s, t in zip(scores, truncated)]
        if self.overlong_buffer_tokens:
            if lengths is None:
                raise ValueError("RewardScorer: reward.overlong_buffer_tokens is set but no response lengths were given")
            shaping = overlong_penalty(torch.tensor(lengths), max_response_length=self.max_response_length,
                                       buffer_tokens=self.overlong_buffer_tokens, penalty_factor=self.overlong_penalty_factor)
            scores = [s + float(p) for s, p in zip(scores, shaping)]
        errors = self.errors - errors_before
        if errors:
            log.warning("reward: %d of %d samples scored 0 after reward errors (reward.on_error=zero)", errors, len(scores))
        self.metrics = {k: float(sum(v) / max(len(v), 1)) for k, v in extra_metrics.items()}
        self.metrics["errors"] = float(errors)
        # Per sample only where every sample has a value (a sample whose reward failed has none).
        self.sample_metrics = {k: [float(x) for x in v] for k, v in extra_metrics.items() if len(v) == len(scores)}
        return scores

    def solved(self, scores: list[float]) -> list[bool]:
        """Per sample of the last call (whose `scores` are given): did it solve its prompt? A well-formatted
        wrong answer can earn reward (`format_weight`), so the reward function's `correct` metric decides
        where there is one; otherwise a reward of at least `solved_threshold`."""
        correct = self.sample_metrics.get("correct")
        if correct is not None and len(correct) == len(scores):
            return [c > 0 for c in correct]
        return [s >= self.solved_threshold for s in scores]

    def _unpack(self, result, n: int) -> tuple[list, dict[str, list[float]]]:
        scores, extra_metrics = result if isinstance(result, tuple) else (result, {})
        scores = list(scores)
        if len(scores) != n:
            raise RewardError(f"reward function {_name(self.fn)} returned {len(scores)} scores for {n} responses; "
                              "fix: return one float per response")
        return scores, dict(extra_metrics)

    def _score_one_by_one(self, prompts, responses, references, extras, batch_error):
        scores, extra_metrics, failed = [], defaultdict(list), 0
        for i in range(len(responses)):
            try:
                one, metrics = self._unpack(self.fn([prompts[i]], [responses[i]], [references[i]], [extras[i]]), 1)
            except Exception as e:
                self._sample_failed(i, prompts, responses, e)
                failed += 1
                scores.append(0.0)
                continue
            scores.extend(one)
            for k, v in metrics.items():
                extra_metrics[k].extend(v)
        if responses and not failed:
            raise RewardError(f"reward function {_name(self.fn)} raised on the batch of {len(responses)} but on no single "
                              f"sample: {type(batch_error).__name__}: {batch_error}; fix: make it work on whole batches")
        return scores, extra_metrics

    def _sample_failed(self, i: int, prompts, responses, error: Exception) -> None:
        if self.on_error == "raise":
            raise RewardError(
                f"reward function {_name(self.fn)} failed on sample {i} (prompt {_clip(prompts[i])!r}, "
                f"response {_clip(responses[i])!r}): {type(error).__name__}: {error}; fix: correct the function, "
                "or set reward.on_error=zero to score such samples 0"
            ) from error
        self.errors += 1


def _is_finite_number(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _name(fn) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial from `_partial_: true`
    if not hasattr(inner, "__qualname__"):  # a callable object
        inner = type(inner)
    return f"{getattr(inner, '__module__', '?')}.{inner.__qualname__}"
