"""The step plan: every count the run will perform, computed once from the config.

Vocabulary (README "Glossary of steps"):
- rollout step: generate responses for one rollout batch of prompts, then train on them.
- optimizer step: one `optimizer.step()` of the actor (the critic takes the same number).
- data epoch: one pass over the prompt dataset.

`compute_plan` is the only place these numbers are derived. The data module, the PPO
loops, the LR schedulers, the logs and the runtime check all read the `StepPlan` it returns.

A `StepPlan` (`step.py`) is the counts every run has (`counts.py`), the models and engine (`models.py`), the
micro-batch layout (`layout.py`) and the source of the old log-probs (`old_logprobs.py`), plus one section per feature,
None when the feature is off: dynamic sampling, episodes, LoRA, rollout workers (`dynamic_sampling.py`, `episodes.py`,
`lora.py`, `workers.py`, the distillation's teacher `teacher.py`, partial rollouts `partial.py`). Each section's module holds its dataclass, the function that computes it and the rows it
writes into the table (`table.py`), from the counts it reads; plan.json is the same sections (`StepPlan.to_dict`). The
notes and warnings are `notes.py`, the run-time checks (`check_*`) `checks.py`, and the plans older releases wrote
`records.py`. A new section: its module, its field, rows and computation in `step.py`, and its name below.
"""

from lit_ppo.plan.checks import (
    check_batch_versions,
    check_carried_tokens,
    check_layout_tokens,
    check_micro_batches,
    check_policy_versions,
    check_rank_balance,
    check_sample_use,
    check_step_accounting,
)
from lit_ppo.plan.counts import Counts
from lit_ppo.plan.dynamic_sampling import DynamicSamplingPlan, expected_dynamic_sampling_rounds
from lit_ppo.plan.episodes import EpisodesPlan
from lit_ppo.plan.layout import LayoutPlan, PromptStats, expected_micro_batch_tokens
from lit_ppo.plan.lora import LoraPlan, LoraTargets
from lit_ppo.plan.models import ModelsPlan
from lit_ppo.plan.old_logprobs import OLD_LOGPROBS_SOURCES, OldLogprobsPlan, old_logprobs_plan
from lit_ppo.plan.partial import PartialPlan
from lit_ppo.plan.records import sections_of
from lit_ppo.plan.step import StepPlan, compute_plan, minibatch_schedule
from lit_ppo.plan.teacher import TeacherPlan
from lit_ppo.plan.workers import WorkersPlan

__all__ = [
    "OLD_LOGPROBS_SOURCES",
    "Counts",
    "DynamicSamplingPlan",
    "EpisodesPlan",
    "LayoutPlan",
    "LoraPlan",
    "LoraTargets",
    "ModelsPlan",
    "OldLogprobsPlan",
    "PromptStats",
    "StepPlan",
    "TeacherPlan",
    "PartialPlan",
    "WorkersPlan",
    "check_batch_versions",
    "check_carried_tokens",
    "check_layout_tokens",
    "check_micro_batches",
    "check_policy_versions",
    "check_rank_balance",
    "check_sample_use",
    "check_step_accounting",
    "compute_plan",
    "expected_dynamic_sampling_rounds",
    "expected_micro_batch_tokens",
    "minibatch_schedule",
    "old_logprobs_plan",
    "sections_of",
]
