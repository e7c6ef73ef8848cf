"""Episodes (rollout.episodes.environment): a sample is one multi-turn episode within a turn and token budget."""

from __future__ import annotations

from dataclasses import dataclass

from lit_ppo.config import RunConfig
from lit_ppo.plan.table import Row


@dataclass(frozen=True)
class EpisodesPlan:
    """Multi-turn episodes: a sample is one episode of at most max_turns policy turns and max_episode_tokens response
    tokens (turns and observations), which is then counts.max_response_tokens."""

    max_turns: int
    max_episode_tokens: int

    def rows(self) -> list[Row]:
        return [
            ("episode: policy turns", self.max_turns, "turns / episode at most (one vLLM call each)"),
            (
                "episode: token budget",
                self.max_episode_tokens,
                "response tokens / episode at most (turns + observations)",
            ),
        ]


def episodes_plan(config: RunConfig) -> EpisodesPlan | None:
    """The episodes' section (None without rollout.episodes.environment): the response width is an episode's budget."""
    rollout = config.rollout
    if not rollout.episodes.environment:
        return None
    return EpisodesPlan(rollout.episodes.max_turns, rollout.episode_tokens())
