"""Partial rollouts' test pieces (tests/rollout/test_partial*.py): the small PPO batch, the rollout settings with a cut,
a fake engine whose samples end where their seed says, its prompts, and tool episodes with a cut."""

from __future__ import annotations

from lit_ppo.config import EpisodesConfig, PPOConfig, RolloutConfig
from lit_ppo.config.partial import PartialConfig
from lit_ppo.contract import GenerateRequest, Generation
from lit_ppo.rollout.prompts import Prompt, PromptSet
from tests.helpers.episodes import ENVIRONMENT

PPO = PPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8, micro_train_batch_size=4)


def partial_rollout(
    step_tokens=4, max_age_steps=1, at_max_age="finish", groups_in_flight=None, **rollout
) -> RolloutConfig:
    return RolloutConfig(
        **{"max_response_tokens": 8, "temperature": 0.7, **rollout},
        partial=PartialConfig(step_tokens, max_age_steps, at_max_age, groups_in_flight),
    )


class CountdownEngine:
    """Samples whose tokens count down to 0, their end: a fresh sample seeded s is (s % 5) * 3 + 1 tokens long, a
    continuation goes on from its prompt's last token. Token t of a call seeded s has log-prob -((s + t) % 97 + 1) /
    100, so a continuation given another sample's seed, or a log-prob put at another token, shows in the log-probs.
    Each call is recorded."""

    adapter_version = 0

    def __init__(self):
        self.requests: list[GenerateRequest] = []

    def generate(self, request: GenerateRequest) -> list[Generation]:
        self.requests.append(request)
        out = []
        for i, (ids, limit) in enumerate(zip(request.prompt_token_ids, request.limits)):
            for j in range(request.n):
                continued = ids[-1] < 40  # the sample's last token: where its countdown stands
                start = ids[-1] if continued else (request.seeds[i] + j) % 5 * 3 + 1
                tokens = list(range(start - 1, -1, -1))[:limit]
                ended = tokens[-1] == 0
                seed = request.seeds[i] + j
                logprobs = [-((seed + t) % 97 + 1) / 100 for t in tokens]
                out.append(Generation(i, tokens, not ended, "x" * len(tokens), logprobs))
        return out

    def wake_up(self):
        pass


def countdown_prompts(count: int) -> PromptSet:
    # Prompt tokens >= 40: a continuation's last prompt token (< 40) tells the fake engine where its sample stands.
    return PromptSet([Prompt([40 + i % 20] * 6, f"p{i}", "0", {}) for i in range(count)], "test")


def episode_rollout(
    environment=ENVIRONMENT, step_tokens=4, max_age_steps=5, at_max_age="finish", **episodes
) -> RolloutConfig:
    """Turns of up to 6 tokens, episodes of up to 3 turns and 24 tokens, cut every 4 policy tokens."""
    return RolloutConfig(
        max_response_tokens=6,
        temperature=0.7,
        episodes=EpisodesConfig(**{"environment": environment, "max_turns": 3, "max_tokens": 24, **episodes}),
        partial=PartialConfig(step_tokens, max_age_steps, at_max_age, groups_in_flight=8),
    )
