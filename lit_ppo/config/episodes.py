"""The `rollout.episodes` section: multi-turn episodes with an environment (docs/environments.md), and its checks."""

from __future__ import annotations

from dataclasses import dataclass

from lit_ppo.config.parse import limit_seconds, positive
from lit_ppo.errors import ConfigError


@dataclass(frozen=True)
class EpisodesConfig:
    """`rollout.episodes`: multi-turn episodes (docs/environments.md); without an environment, single-turn responses."""

    environment: dict | str | None = None
    """The environment (`_target_`: a class by dotted path, and its arguments), one built per episode
    (lit_ppo/environments.py, docs/environments.md); a dotted path alone is `{_target_: path}` (a class built without
    arguments); null: single-turn responses."""
    max_turns: int = 1
    """With an environment: policy turns per episode at most (a turn is up to rollout.max_response_tokens tokens)."""
    max_tokens: int | None = None
    """With an environment: tokens per episode response (turns and observations) at most; null: max_turns x
    rollout.max_response_tokens."""
    environment_timeout_s: float | None = 60.0
    """With an environment: seconds one reset/step call may take; longer is a failure handled by reward.on_error."""
    observation_role: str = "tool"
    """With data.chat_template=true: the chat role whose turn separators wrap an observation."""
    reward: str = "environment"
    """environment: the sum of the environment's step rewards; reward: reward.fn scores the episode's whole response."""
    check_token_ids: bool = True
    """With an environment: check that the ids the trainer packs are the ids vLLM was given and produced."""

    def __post_init__(self) -> None:
        if isinstance(self.environment, str):  # `rollout.episodes.environment=my_tools.Calculator`: no arguments
            object.__setattr__(self, "environment", {"_target_": self.environment})
        validate_episodes(self)


def validate_episodes(episodes: EpisodesConfig) -> None:
    """The episode budgets and the reward's source."""
    positive("rollout.episodes", max_turns=episodes.max_turns)
    if episodes.max_tokens is not None:
        positive("rollout.episodes", max_tokens=episodes.max_tokens)
    limit_seconds("rollout.episodes.environment_timeout_s", episodes.environment_timeout_s)
    if episodes.reward not in ("environment", "reward"):
        raise ConfigError(f"rollout.episodes.reward={episodes.reward!r}; fix: use environment or reward")
    if episodes.environment is None and episodes.max_turns > 1:
        raise ConfigError(
            f"rollout.episodes.max_turns={episodes.max_turns} without rollout.episodes.environment: nothing answers the "
            "policy between turns; fix: set rollout.episodes.environment._target_ (docs/environments.md) or max_turns=1"
        )
