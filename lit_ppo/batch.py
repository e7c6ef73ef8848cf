"""The rollout batch: what the rollout side (lit_ppo/rollout/datamodule.py and the engines) hands to the training side
(lit_ppo/training/module.py, batching.py, experience.py, metrics.py). Both import it; neither imports the other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class RolloutBatch:
    """This rank's samples of one rollout step; samples of a prompt are contiguous. Per-sample lists are in the
    same order; N is their length."""

    rollout_step: int
    data_epoch: int
    prompt_positions: list[int]  # per sample: its prompt's position in the GLOBAL rollout batch
    dataset_indices: list[int]  # per sample: its prompt's index in the training prompts
    prompt_ids: list[list[int]]  # per sample
    response_ids: list[list[int]]  # per sample
    # per sample, per response token: the sampler's (vLLM's) log-prob of the sampled token, after temperature
    # and top-p; None for batches that no sampler produced (benchmarks with fixed responses)
    rollout_logprobs: list[list[float]] | None
    rewards: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] bool
    prompts: list[str]
    responses: list[str]
    references: list
    generate_seconds: float
    reward_seconds: float
    reward_metrics: dict[str, float]
    # Dynamic sampling (global counts, the same on every rank); one round of rollout_batch_size prompts without it.
    generation_rounds: int = 1
    dropped_groups: int = 0  # groups of equal rewards left out of the batch
    filled_groups: int = 0  # of those, groups put back to fill a shortfall (on_shortfall=fill)
    prompts_consumed: int = 0  # prompts drawn from the data in this rollout step
    # LoRA runs (model.lora): per sample, the adapter version the engine sampled it with (the trainer checks it is
    # its own); None without LoRA, and 0 where the engine shares the actor (rollout.engine=hf) or ran episodes.
    adapter_versions: list[int] | None = None
    # Multi-turn episodes (rollout.episodes.environment); None/empty for single-turn responses.
    policy_masks: list[list[int]] | None = None  # per sample, per response token: 1 policy, 0 observation
    episode_ids: list[list[int]] | None = None  # per sample: prompt + response as vLLM saw them (check_token_ids)
    episode_stats: dict[str, float] = field(default_factory=dict)  # this rank's sums (episodes.EPISODE_STATS)
    # Per sample: the policy version that generated it (the weights after that many rollout steps; the plan's schedule
    # says which: StepPlan.generating_version); None for batches that no engine produced.
    policy_versions: list[int] | None = None
    # Dynamic sampling: per sample, the generation round of its rollout step that drew it (0: the first), which with
    # rollout workers says which version the plan gives it (refill rounds: the step's own); None without.
    rounds_in_step: list[int] | None = None
    # ... and with rollout workers the rounds the step was requested ahead with (the plan's, or fewer where a checkpoint
    # kept the step under other ppo.dynamic_sampling settings: its further rounds are refill rounds, version s).
    rounds_ahead: int | None = None
    # Partial rollouts (rollout.partial): per sample, which policy version generated which of its response tokens,
    # (first token index, version) spans in token order; None without.
    version_spans: list[list[list[int]]] | None = None
    # ... and their statistics of this rollout step (rollout/carried_samples, rollout/token_age_*, ...); empty without.
    partial_stats: dict[str, float] = field(default_factory=dict)
    # Seconds the trainer waited for this batch (mode=disaggregated: what generation cost the critical path).
    wait_seconds: float | None = None

    def with_samples(self, shares: list[RolloutBatch], picks: list[tuple[int, int]]) -> RolloutBatch:
        """This batch's per-rank fields (RANK_FIELDS) with the samples `picks`, (share, sample index) each, of `shares`
        (every rank's batch of this rollout step): how ranks trade samples
        (`training/rank_samples.py:balanced_rank_batch`). A per-sample field that a batch has not (None) stays None."""
        values = {}
        for name in SAMPLE_FIELDS:
            columns = [getattr(share, name) for share in shares]
            if any(column is None for column in columns):
                values[name] = None
            elif isinstance(columns[0], torch.Tensor):
                values[name] = torch.stack([columns[s][i] for s, i in picks]) if picks else columns[0][:0]
            else:
                values[name] = [columns[s][i] for s, i in picks]
        return dataclasses.replace(self, **values)


# RolloutBatch's fields with one entry per sample (lists, [N] tensors), which move with their samples between ranks, and
# those of the rank's whole rollout step (its generation's seconds, its reward means and episode sums, global counts),
# which stay: with as many samples on every rank, the logged means and sums over ranks do not change.
SAMPLE_FIELDS = (
    "prompt_positions",
    "dataset_indices",
    "prompt_ids",
    "response_ids",
    "rollout_logprobs",
    "rewards",
    "truncated",
    "prompts",
    "responses",
    "references",
    "adapter_versions",
    "policy_masks",
    "episode_ids",
    "policy_versions",
    "rounds_in_step",
    "version_spans",
)
RANK_FIELDS = (
    "rollout_step",
    "data_epoch",
    "generate_seconds",
    "reward_seconds",
    "reward_metrics",
    "generation_rounds",
    "dropped_groups",
    "filled_groups",
    "prompts_consumed",
    "episode_stats",
    "wait_seconds",
    "rounds_ahead",
    "partial_stats",
)
