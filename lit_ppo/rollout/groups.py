"""A rollout step's samples by prompt (`PromptGroup`: one prompt's n samples and their rewards), dynamic sampling's
choice among them (`select_informative_groups`), as the data module moves them between generation rounds and ranks,
their rewards (`score_generations`, `environment_rewards`) and the rollout batch of what a step drew (`StepDraw`,
`rollout_batch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lit_ppo.batch import RolloutBatch
from lit_ppo.contract import Generation
from lit_ppo.distributed import all_gather_objects
from lit_ppo.plan import StepPlan
from lit_ppo.rewards.scorer import RewardScorer, Scores
from lit_ppo.rollout.prompts import Prompt

REWARD_COUNTS = ("errors", "timeouts", "none")
"""The scorer's per-call counts (`Scores.metrics`), summed over a rollout step's generation rounds."""


@dataclass
class PromptGroup:
    """One prompt's n samples and their rewards, as dynamic sampling moves them between rounds and ranks."""

    dataset_index: int
    prompt: Prompt
    generations: list[Generation]
    rewards: list[float]
    sample_metrics: dict[str, list[float]]
    policy_versions: list[int]  # per generation: the policy version that generated it
    round_in_step: int = 0  # the generation round of its rollout step that drew it (0: the first)

    @property
    def informative(self) -> bool:
        """Rewards that differ: a group-relative advantage that is not zero everywhere."""
        return max(self.rewards) != min(self.rewards)


def select_informative_groups(drawn: list[PromptGroup], rollout_batch_size: int) -> tuple[list[PromptGroup], int, int]:
    """Dynamic sampling's choice from the groups drawn in a rollout step (all ranks', in global order): the first
    `rollout_batch_size` groups whose rewards differ, completed with the uniform groups drawn first when there are too
    few (on_shortfall=fill), so the choice depends on nothing but the data order. Returns (the batch's groups, uniform
    groups dropped, uniform groups filled back in)."""
    informative = [g for g in drawn if g.informative]
    uniform = [g for g in drawn if not g.informative]
    filled = max(0, rollout_batch_size - len(informative))
    return (informative + uniform[:filled])[:rollout_batch_size], len(uniform), filled


def score_generations(scorer: RewardScorer, prompts: list[Prompt], generations: list) -> Scores:
    """Rewards of generations; `g.prompt_index` points into `prompts`."""
    of = [prompts[g.prompt_index] for g in generations]
    return scorer(
        [p.text for p in of],
        [g.text for g in generations],
        [p.reference for p in of],
        [p.extras for p in of],
        [g.truncated for g in generations],
        lengths=[len(g.token_ids) for g in generations],
    )


def environment_rewards(samples: list) -> tuple[list[float], dict[str, list[float]], dict[str, float]]:
    """(rewards, per-sample metrics, their means) of episodes scored by their environment (the sum of its step
    rewards; the metrics its infos')."""
    rewards = [g.reward for g in samples]
    keys = set.intersection(*(set(g.info) for g in samples)) if samples else set()
    per_sample = {k: [g.info[k] for g in samples] for k in sorted(keys)}
    metrics = {k: sum(v) / max(len(v), 1) for k, v in per_sample.items()}
    metrics["errors"] = 0.0  # the environment's failures are counted as rollout/environment_errors
    return rewards, per_sample, metrics


def all_groups(groups: list[PromptGroup]) -> list[PromptGroup]:
    """Every rank's groups of one round, in global prompt order (rank 0's share first)."""
    return [group for share in all_gather_objects(groups) for group in share]


def batch_reward_metrics(groups: list[PromptGroup], counts: dict[str, float]) -> dict[str, float]:
    """Means of the reward function's per-sample metrics over this rank's kept samples, and this rank's counts of
    reward errors, timeouts and None scores (REWARD_COUNTS) in all of the step's rounds."""
    keys = set.intersection(*(set(g.sample_metrics) for g in groups)) if groups else set()
    values = {k: [x for g in groups for x in g.sample_metrics[k]] for k in sorted(keys)}
    metrics = {k: float(sum(v) / max(len(v), 1)) for k, v in values.items()}
    metrics.update({k: float(v) for k, v in counts.items()})
    return metrics


@dataclass
class StepDraw:
    """What a rollout step's generation rounds drew for this rank: its groups (with dynamic sampling: its share of
    those chosen), their reward metrics, the seconds spent (the trainer's wait for the generations: None where it does
    not wait for a source), the rounds and the last run-wide round used (its data epoch), the groups dropped and
    filled."""

    groups: list[PromptGroup]
    reward_metrics: dict[str, float]
    generate_seconds: float
    reward_seconds: float
    wait_seconds: float | None
    rounds: int = 1
    dropped: int = 0
    filled: int = 0
    last_round: int = 0


def rollout_batch(
    rollout_step: int,
    plan: StepPlan,
    positions: range,
    draw: StepDraw,
    rounds_ahead: int | None,
    episode_fields: Callable[[list], dict],
) -> RolloutBatch:
    """This rank's RolloutBatch of `draw` (`positions`: its groups' prompt positions in the rollout batch;
    `episode_fields`: the fields of multi-turn episodes of its samples)."""
    groups = draw.groups
    samples = [(position, group, g) for position, group in zip(positions, groups) for g in group.generations]
    return RolloutBatch(
        rollout_step=rollout_step,
        data_epoch=draw.last_round // plan.counts.generation_rounds_per_data_epoch,
        prompt_positions=[position for position, _, _ in samples],
        dataset_indices=[group.dataset_index for _, group, _ in samples],
        prompt_ids=[group.prompt.prompt_ids for _, group, _ in samples],
        response_ids=[g.token_ids for _, _, g in samples],
        rollout_logprobs=[g.logprobs for _, _, g in samples],
        rewards=torch.tensor([r for group in groups for r in group.rewards], dtype=torch.float32),
        truncated=torch.tensor([g.truncated for _, _, g in samples]),
        prompts=[group.prompt.text for _, group, _ in samples],
        responses=[g.text for _, _, g in samples],
        references=[group.prompt.reference for _, group, _ in samples],
        generate_seconds=draw.generate_seconds,
        reward_seconds=draw.reward_seconds,
        reward_metrics=draw.reward_metrics,
        generation_rounds=draw.rounds,
        dropped_groups=draw.dropped,
        filled_groups=draw.filled,
        prompts_consumed=draw.rounds * plan.counts.prompts_per_generation_round,
        policy_versions=[v for group in groups for v in group.policy_versions],
        rounds_in_step=[g.round_in_step for g in groups for _ in g.generations] if plan.dynamic_sampling else None,
        rounds_ahead=rounds_ahead,
        wait_seconds=draw.wait_seconds,
        adapter_versions=[g.adapter_version for _, _, g in samples] if plan.lora else None,
        **episode_fields([g for _, _, g in samples]),
    )
