"""The teacher of on-policy distillation (`model.teacher`, `ppo.advantage_estimator=on_policy_distill`): which model,
in which dtype, where it runs, and its forwards per rollout step."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lit_ppo.config import RunConfig
from lit_ppo.plan.counts import Counts
from lit_ppo.plan.table import Row


@dataclass(frozen=True)
class TeacherPlan:
    """The teacher: frozen, never checkpointed; its no-grad forward runs beside the experience forwards."""

    path: str  # the in-process teacher's directory; "" for a server's
    dtype: str
    where: str  # model.teacher.where: trainer (in each training process, in the reference model's place) or a URL
    teacher_coef: float
    reward_coef: float
    reward_estimator: str
    # No-grad forwards of the teacher per rollout step and rank: one per experience micro-batch (a fixed count with
    # fixed-size micro-batches; None with a token budget, whose count varies with the lengths).
    forwards_per_rollout_step: int | None
    temperature: float = 1.0  # the teacher's log-probs are of softmax(logits / temperature) (model.teacher.temperature)

    @property
    def on_server(self) -> bool:
        return self.where != "trainer"

    def rows(self) -> list[Row]:
        forwards = self.forwards_per_rollout_step
        scored = f"scored at temperature {self.temperature:g}"
        if self.on_server:
            return [
                (
                    "teacher model",
                    self.where,
                    f"on a vLLM server: its prompt log-probs of the sampled sequences, {scored}; no weights in the "
                    "trainer (model.teacher.where)",
                ),
                self.advantage_row(),
            ]
        return [
            (
                "teacher model",
                self.path,
                f"{self.dtype}, frozen, in each training process: its forward in the reference model's place, the same layout, "
                f"{scored} (model.teacher)",
            ),
            (
                "teacher forwards",
                "varies" if forwards is None else forwards,
                "no-grad forwards / rollout step / rank (one per experience micro-batch)",
            ),
            self.advantage_row(),
        ]

    def advantage_row(self) -> Row:
        return (
            "advantage",
            "on_policy_distill",
            f"{self.teacher_coef:g} x -(log p_student - log p_teacher) per token"
            + (f" + {self.reward_coef:g} x {self.reward_estimator}'s reward advantage" if self.reward_coef else "")
            + " (ppo.distill)",
        )


def teacher_plan(config: RunConfig, counts: Counts) -> TeacherPlan | None:
    """The teacher's section, None without one."""
    teacher, ppo = config.model.teacher, config.ppo
    if teacher is None or ppo.advantage_estimator != "on_policy_distill":
        return None
    forwards = (
        math.ceil(counts.samples_per_rank_per_rollout_step / ppo.micro_train_batch_size)
        if ppo.micro_train_max_tokens is None and not teacher.on_server
        else None
    )
    return TeacherPlan(
        path=str(teacher.path or ""),
        dtype=teacher.dtype,
        where=teacher.where,
        teacher_coef=ppo.distill.teacher_coef,
        reward_coef=ppo.distill.reward_coef,
        reward_estimator=ppo.distill.reward_estimator,
        forwards_per_rollout_step=forwards,
        temperature=teacher.scoring_temperature(config.rollout.temperature),
    )
