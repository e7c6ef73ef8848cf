"""The step plan: `StepPlan`, its sections (one module each, beside this one) and `compute_plan`, which computes
each section by its own function, in the order one reads another's counts."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from lit_ppo.config import RunConfig
from lit_ppo.plan.counts import Counts, check_batch_sizes, counts_plan
from lit_ppo.plan.dynamic_sampling import DynamicSamplingPlan, dynamic_sampling_plan
from lit_ppo.plan.episodes import EpisodesPlan, episodes_plan
from lit_ppo.plan.layout import LayoutPlan, PromptStats, layout_plan
from lit_ppo.plan.lora import LoraPlan, LoraTargets, lora_plan
from lit_ppo.plan.models import ModelsPlan, models_plan
from lit_ppo.plan.notes import plan_notes, plan_warnings
from lit_ppo.plan.old_logprobs import OldLogprobsPlan, old_logprobs_plan
from lit_ppo.plan.partial import PartialPlan, partial_plan
from lit_ppo.plan.table import Row, format_table
from lit_ppo.plan.teacher import TeacherPlan, teacher_plan
from lit_ppo.plan.workers import WorkersPlan, workers_plan


@dataclass(frozen=True)
class StepPlan:
    """What the run will do, in numbers. Every loop and scheduler reads this."""

    counts: Counts
    models: ModelsPlan
    layout: LayoutPlan
    old_logprobs: OldLogprobsPlan
    dynamic_sampling: DynamicSamplingPlan | None = None
    episodes: EpisodesPlan | None = None
    lora: LoraPlan | None = None
    workers: WorkersPlan | None = None
    teacher: TeacherPlan | None = None
    partial: PartialPlan | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # settings that run but train off what was sampled

    @property
    def max_staleness(self) -> int:
        """k of the generation schedule: the rollout workers' (rollout.max_staleness), 0 without them."""
        return self.workers.max_staleness if self.workers else 0

    def generating_version(self, rollout_step: int, round_in_step: int = 0, rounds_ahead: int | None = None) -> int:
        """The policy version (the weights after that many rollout steps) that generates `rollout_step`'s samples of
        its generation round `round_in_step` (0: the first): max(0, s - k), except the refill rounds of dynamic
        sampling with rollout workers (those beyond the rounds requested ahead), which are requested once the step's
        rewards are in, from the workers' newest version, s. `rounds_ahead`: the rounds the step was requested ahead
        with, where a checkpoint kept it under other dynamic sampling settings (None: the plan's)."""
        ds = self.dynamic_sampling
        ahead = rounds_ahead if rounds_ahead is not None else (ds.rounds_requested_ahead if ds is not None else None)
        if ds is not None and ahead is not None and round_in_step >= ahead:
            return rollout_step
        return max(0, rollout_step - self.max_staleness)

    def schedule(self) -> str:
        """The generation schedule in words: which policy version generates which rollout step (0-based)."""
        k, last = self.max_staleness, self.counts.total_rollout_steps - 1
        shown = [s for s in range(min(last + 1, k + 3))]
        text = ", ".join(f"step {s} <- v{self.generating_version(s)}" for s in shown)
        return text + (f", ..., step {last} <- v{self.generating_version(last)}" if last not in shown else "")

    def to_dict(self) -> dict[str, Any]:
        """plan.json: {section: {field: value} or None (the feature off), notes, warnings}."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def rows(self) -> list[Row]:
        """The table's lines in its order, each section's from the counts it reads; a section that is None (its
        feature off) has none."""
        counts, models, critic = self.counts, self.models, self.models.critic_enabled
        rows = counts.rollout_rows()
        if self.dynamic_sampling is not None:
            rows += self.dynamic_sampling.rows(counts, self.max_staleness)
        rows += counts.update_rows(critic)
        rows += self.layout.rows(counts)
        rows += self.old_logprobs.rows()
        if self.episodes is not None:
            rows += self.episodes.rows()
        rows += counts.total_rows(critic, episodes=self.episodes is not None)
        if self.lora is not None:
            rows += self.lora.rows(critic, models.precision)
        rows += models.rows(workers=self.workers is not None, lora=self.lora)
        if self.teacher is not None:
            rows += self.teacher.rows()
        if self.partial is not None:
            rows += self.partial.rows()
        if self.workers is not None:
            rows += self.workers.rows(counts.data_parallel_size, self.schedule(), self.dynamic_sampling is not None)
        return rows

    def table(self) -> str:
        """A human-readable table, one line per number, with its unit."""
        return format_table(self.rows(), self.notes, self.warnings)


# plan.json's sections by their key, the fields of StepPlan (records.py reads an older, flat plan by them).
SECTIONS = {
    "counts": Counts,
    "models": ModelsPlan,
    "layout": LayoutPlan,
    "old_logprobs": OldLogprobsPlan,
    "dynamic_sampling": DynamicSamplingPlan,
    "episodes": EpisodesPlan,
    "lora": LoraPlan,
    "workers": WorkersPlan,
    "teacher": TeacherPlan,
    "partial": PartialPlan,
}


def compute_plan(
    config: RunConfig,
    dataset_prompts: int,
    prompt_stats: PromptStats | None = None,
    lora_targets: LoraTargets | None = None,
) -> StepPlan:
    """Derive every count of the run from its typed settings and the number of training prompts, or raise
    ConfigError naming the inconsistent keys. `prompt_stats`, the training prompts' lengths, give the expected tokens
    per micro-batch (`expected_micro_batch_tokens`); without them the plan says they are unknown. `lora_targets`, the
    modules model.lora adapts as the pre-flight matched them on the model, give the adapter's size.

    The precision and vLLM's dtype are resolved here (`lit_ppo.precision`). With an environment a sample is an episode
    of up to `rollout.episodes.max_turns` turns whose response is at most `rollout.episode_tokens()` tokens, which is
    then the response width the trainer plans for. Each section is computed by its own function, in its own module."""
    ppo, rollout = config.ppo, config.rollout
    check_batch_sizes(ppo, config.strategy.data_parallel_size, dataset_prompts)
    dynamic_sampling = dynamic_sampling_plan(
        ppo, config.trainer, config.strategy.data_parallel_size, dataset_prompts, rollout.mode == "disaggregated"
    )
    counts = counts_plan(config, dataset_prompts)
    source, old_logprobs_note = old_logprobs_plan(ppo, counts.mini_batches_per_ppo_epoch)
    models = models_plan(config)
    return StepPlan(
        counts=counts,
        models=models,
        layout=layout_plan(config, counts, prompt_stats),
        old_logprobs=OldLogprobsPlan(source),
        dynamic_sampling=dynamic_sampling,
        episodes=episodes_plan(config),
        lora=lora_plan(config, lora_targets),
        workers=workers_plan(config),
        teacher=teacher_plan(config, counts),
        partial=partial_plan(config, counts),
        notes=plan_notes(config, counts, dynamic_sampling, old_logprobs_note),
        warnings=plan_warnings(config, models),
    )


def minibatch_schedule(plan: StepPlan, num_samples: int, generator) -> list[list[list[int]]]:
    """Per PPO epoch, the global mini-batches of train_batch_size indices of the rollout step's `num_samples` samples
    (all ranks', in one process's order), reshuffled every epoch by `generator` (seeded by ppo.shuffle_seed, the same
    on every rank, checkpointed): the same on any number of ranks, each of which trains its share of every
    mini-batch (`training/rank_samples.py:rank_share`)."""
    import torch  # the plan itself needs no torch (mode=plan)

    size = plan.counts.train_batch_size
    schedule = []
    for _ in range(plan.counts.ppo_epochs):
        order = torch.randperm(num_samples, generator=generator).tolist()
        schedule.append([order[start : start + size] for start in range(0, num_samples, size)])
    return schedule
