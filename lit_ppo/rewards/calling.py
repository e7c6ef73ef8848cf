"""How a reward function is called: lit-ppo's own convention and those of TRL, verl and OpenRLHF, told apart by the
function's parameter names (`detect_signature`) and adapted to one call (`RewardCall`)."""

from __future__ import annotations

import inspect
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_ppo.errors import ConfigError, RewardError

log = logging.getLogger("lit_ppo")


SIGNATURES = ("auto", "lit_ppo", "trl", "verl", "openrlhf")


# The parameter that only one convention names: how `auto` tells them apart.
SIGNATURE_MARKERS = {"lit_ppo": "responses", "trl": "completions", "verl": "solution_str", "openrlhf": "queries"}


def _parameters(fn) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)  # a functools.partial's bound keywords stay, with defaults
    except (TypeError, ValueError):
        return {}


def detect_signature(fn) -> str:
    """Which convention `fn` follows, from its parameter names (see `RewardCall`).

    Exactly one of `responses` (lit-ppo), `completions` (TRL), `solution_str` (verl), `queries` (OpenRLHF)
    decides; a function naming none of them but taking four positional arguments is lit-ppo's
    `(prompts, responses, references, extras)` under other names. Anything else is a ConfigError."""
    return convention_of(_parameters(fn), _name(fn))


def convention_of(parameters: dict[str, inspect.Parameter], name: str) -> str:
    """`detect_signature` on a function's parameters (`name` for the message): also for a class's `__call__`
    that is not built yet (the pre-flight checks, lit_ppo/run/user_code.py)."""
    found = [convention for convention, marker in SIGNATURE_MARKERS.items() if marker in parameters]
    if len(found) == 1:
        return found[0]
    positional = [
        p
        for p in parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if not found and len(positional) >= 4:
        return "lit_ppo"
    shown = f"({', '.join(parameters)})" if parameters else "(parameters unknown)"
    raise ConfigError(
        f"reward.signature=auto cannot tell how to call {name}{shown}: it names "
        f"{' and '.join(SIGNATURE_MARKERS[f] for f in found) if found else 'none'} of "
        f"{', '.join(SIGNATURE_MARKERS.values())}; fix: set reward.signature to one of {', '.join(SIGNATURES[1:])}, "
        "or give it the parameters of one of them (docs/rewards.md)"
    )


def _as_list(values, n: int, what: str) -> list:
    if hasattr(values, "tolist"):  # a tensor or an array
        values = values.tolist()
    if isinstance(values, (int, float)) and n == 1:
        values = [values]
    try:
        values = list(values)
    except TypeError:
        raise RewardError(
            f"{what} is a {type(values).__name__}, not one value per sample; fix: return a list"
        ) from None
    return values


@dataclass
class RewardCall:
    """The user's reward function, called as the framework it was written for calls it; always returns
    `(scores, metrics)`: one score per sample (a float, or None, see below) and per-sample metric lists.

    - `lit_ppo`: `fn(prompts, responses, references, extras)` -> scores, or (scores, {name: per-sample values}).
    - `trl`: `fn(prompts=..., completions=..., <answer column>=references, **<extra columns>)`, TRL's
      `reward_funcs` contract: the dataset's other columns as keyword lists (`data.answer_key` names the
      reference column, `data.extra_keys` the others; only those the function accepts unless it takes
      **kwargs). Prompts and completions are text. It returns a list of floats, where None means what it
      means in TRL, "this function does not apply to this sample": the sample scores 0 and is counted in
      `rollout/reward_none` (not an error).
    - `verl`: `fn(data_source=..., solution_str=response, ground_truth=reference, extra_info=extras)` per
      sample (verl's `compute_score`); `data_source` is the record's `data_source` field when
      `data.extra_keys` lists it, else "". It returns a number, or a dict whose `score` is the reward
      and whose other numeric entries are logged as `rollout/reward_<key>`.
    - `openrlhf`: `fn(queries, prompts, labels)` on the batch (OpenRLHF's `--remote_rm_url` file):
      queries are prompt + response, labels the references. It returns a tensor or list of rewards, or
      a dict with `rewards` (and optionally `scores`, unused, and `extra_logs`, logged like metrics).
    """

    fn: Callable[..., Any]
    signature: str
    reference_key: str | None = "answer"

    def __call__(self, prompts: list[str], responses: list[str], references: list, extras: list[dict]):
        return getattr(self, f"_{self.signature}")(prompts, responses, references, extras)

    def _lit_ppo(self, prompts, responses, references, extras):
        result = self.fn(prompts, responses, references, extras)
        scores, metrics = result if isinstance(result, tuple) else (result, {})
        return _as_list(scores, len(responses), "the reward"), {
            k: _as_list(v, len(responses), k) for k, v in dict(metrics).items()
        }

    def _accepted(self, keywords: dict) -> dict:
        parameters = _parameters(self.fn)
        if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return keywords
        return {k: v for k, v in keywords.items() if k in parameters}

    def _trl(self, prompts, responses, references, extras):
        columns = {key: [e.get(key) for e in extras] for key in (extras[0] if extras else {})}
        if self.reference_key:
            columns[self.reference_key] = list(references)
        scores = self.fn(prompts=list(prompts), completions=list(responses), **self._accepted(columns))
        return _as_list(scores, len(responses), "the reward"), {}

    def _verl(self, prompts, responses, references, extras):
        scores, metrics = [], defaultdict(list)
        for response, reference, extra in zip(responses, references, extras):
            result = self.fn(
                **self._accepted(
                    {
                        "data_source": extra.get("data_source", ""),
                        "solution_str": response,
                        "ground_truth": reference,
                        "extra_info": dict(extra),
                    }
                )
            )
            if isinstance(result, dict):
                if "score" not in result:
                    raise RewardError(
                        f"{_name(self.fn)} returned a dict without `score` ({sorted(result)}); "
                        "fix: return a number or a dict with `score`, as verl expects"
                    )
                for key, value in result.items():
                    if key != "score" and isinstance(value, (int, float)):
                        metrics[key].append(float(value))
                result = result["score"]
            scores.append(result)
        return scores, {k: v for k, v in metrics.items() if len(v) == len(scores)}

    def _openrlhf(self, prompts, responses, references, extras):
        result = self.fn([p + r for p, r in zip(prompts, responses)], list(prompts), list(references))
        metrics = {}
        if isinstance(result, dict):
            if "rewards" not in result:
                raise RewardError(
                    f"{_name(self.fn)} returned a dict without `rewards` ({sorted(result)}); "
                    "fix: return the rewards, or a dict with `rewards`, as OpenRLHF expects"
                )
            for key, value in (result.get("extra_logs") or {}).items():
                values = (
                    _as_list(value, len(responses), key)
                    if not isinstance(value, (int, float))
                    else [value] * len(responses)
                )
                if len(values) == len(responses):
                    metrics[key] = [float(v) for v in values]
            result = result["rewards"]
        return _as_list(result, len(responses), "the reward"), metrics


def _name(fn) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial from `_partial_: true`
    if not hasattr(inner, "__qualname__"):  # a callable object
        inner = type(inner)
    return f"{getattr(inner, '__module__', '?')}.{inner.__qualname__}"
