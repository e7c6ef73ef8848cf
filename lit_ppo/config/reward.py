"""The `reward` section: the reward function and how it is called, and the overlong shaping's check against the
response budget."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from lit_ppo.config_fields import above, at_least
from lit_ppo.errors import ConfigError

OnError = Literal["raise", "zero"]  # reward.on_error
ON_ERROR = typing.get_args(OnError)


def check_overlong_buffer(buffer_tokens: int, response_budget_tokens: int) -> None:
    """DAPO's soft overlong shaping (`reward.overlong_buffer_tokens`) ends at the response budget, so it must lie
    within it."""
    if buffer_tokens and not 0 < buffer_tokens < response_budget_tokens:
        raise ConfigError(
            f"reward.overlong_buffer_tokens={buffer_tokens} must lie in (0, {response_budget_tokens}) "
            "(the response budget: rollout.max_response_tokens, or rollout.episodes.max_tokens with an environment); "
            "fix: e.g. a quarter of the budget, or 0 to turn the shaping off"
        )


@dataclass(frozen=True)
class RewardConfig:
    """The `reward` group: the reward function and how it is called (lit_ppo/rewards.py, docs/rewards.md)."""

    fn: dict = field(default_factory=lambda: {"_target_": "lit_ppo.rewards.integer_match", "_partial_": True})
    """The function or callable class by dotted path (`_target_`), built by Hydra."""
    signature: str = "auto"
    """auto | lit_ppo | trl | verl | openrlhf: how to call fn (auto: from its parameter names)."""
    on_error: OnError = "raise"
    """raise: stop naming the sample; zero: score 0 and count it."""
    workers: int = field(default=0, metadata=at_least(0))
    """0: score in this process; N: in N worker processes, one sample at a time each."""
    timeout_s: float | None = field(default=60, metadata=above(0))
    """With workers > 0: seconds per sample before its worker is killed (then on_error); with workers = 0: seconds per
    call, the batch, then each sample alone. Either way the call's rest is not scored after 2 samples in a row time
    out."""
    overlong_penalty: float = 0.0
    """Subtracted from responses that hit the response budget."""
    overlong_buffer_tokens: int = field(default=0, metadata=at_least(0))
    """DAPO soft overlong shaping: 0 off; else a linear penalty over the last N tokens before the response budget."""
    overlong_penalty_factor: float = 1.0
    """... reaching -factor at the response budget."""
    solved_threshold: float = 1.0
    """pass@k: a sample solves its prompt at this reward (a `correct` metric decides where returned)."""
