"""What the plan says in words beside its numbers: its notes (what a count means in this run) and its warnings
(settings that run but train off what was sampled)."""

from __future__ import annotations

import math

from lit_ppo.config import RunConfig, other_engines_settings_set
from lit_ppo.plan.counts import Counts
from lit_ppo.plan.dynamic_sampling import DynamicSamplingPlan
from lit_ppo.plan.models import ModelsPlan


def plan_notes(
    config: RunConfig, counts: Counts, dynamic_sampling: DynamicSamplingPlan | None, old_logprobs_note: str
) -> list[str]:
    """What the plan says in words beside its numbers: dropped prompts, partial data epochs, what dynamic sampling and
    asynchronous rollouts do to the counts, settings a run does not use."""
    ppo, rollout = config.ppo, config.rollout
    per_round, rounds_per_data_epoch = counts.prompts_per_generation_round, counts.generation_rounds_per_data_epoch
    notes = []
    if counts.prompts_dropped_per_data_epoch:
        notes.append(
            f"each data epoch uses {rounds_per_data_epoch * per_round} of {counts.dataset_prompts} prompts; "
            f"the last {counts.prompts_dropped_per_data_epoch} (a partial {'generation round' if dynamic_sampling else 'rollout batch'}) are dropped and the order is reshuffled every data epoch"
        )
    if dynamic_sampling:
        max_rounds, steps = dynamic_sampling.max_generation_rounds, counts.total_rollout_steps
        notes.append(
            f"dynamic sampling: each rollout step draws rounds of {per_round} prompts ({max_rounds} at most) until "
            f"{ppo.rollout_batch_size} prompts with differing rewards are collected; the optimizer steps per rollout step "
            f"stay {counts.optimizer_steps_per_rollout_step}. Data epochs and samples generated are lower bounds (up to "
            f"{max_rounds * per_round * steps / (rounds_per_data_epoch * per_round):.3f} data epochs and "
            f"{max_rounds * per_round * ppo.n_samples_per_prompt * steps} samples)"
        )
    elif abs(counts.data_epochs - round(counts.data_epochs)) > 1e-9:
        notes.append(
            f"the run ends inside data epoch {math.ceil(counts.data_epochs)} ({counts.data_epochs:.3f} data epochs)"
        )
    if old_logprobs_note:
        notes.append(old_logprobs_note)
    k = rollout.staleness()
    if rollout.mode == "disaggregated" and k > 0:
        notes.append(
            f"asynchronous rollouts: samples are up to {k} rollout step(s) old; the PPO ratio's old log-probs are "
            "recomputed with the weights each step starts from and ppo.rollout_correction="
            f"{ppo.rollout_correction.mode} weights the tokens by old / behaviour (vLLM's) probability (docs/async.md)"
        )
    # e.g. an experiment written for vLLM, run with rollout.engine=hf: said, not silently dropped
    for label, unused in other_engines_settings_set(rollout).items():
        notes.append(
            f"rollout.engine={rollout.engine} does not use the {label.removeprefix('the ')} setting(s) {', '.join(unused)}"
        )
    return notes


def plan_warnings(config: RunConfig, models: ModelsPlan) -> list[str]:
    """Settings that run but train off what was sampled, or barely train."""
    warnings = []
    if config.rollout.top_p < 1:
        warnings.append(
            f"rollout.top_p={config.rollout.top_p} < 1: vLLM samples from the truncated distribution but the trainer's "
            "log-probs are of the whole one, so updates are off-distribution (rollout/logprob_abs_diff shows by how "
            "much); fix: top_p=1"
        )
    if models.precision == "bf16-true":
        warnings.append(
            "strategy.precision=bf16-true keeps weights and AdamW states in bf16: an update smaller than 2^-8 of a weight "
            "rounds away (lr 1e-6 on |w| = 0.02 changes almost nothing); fix: strategy.precision=bf16-mixed (float32 "
            "master weights)"
        )
    return warnings
