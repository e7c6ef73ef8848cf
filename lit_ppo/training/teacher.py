"""On-policy distillation's teacher in the training process (`model.teacher.where=trainer`): loaded once, frozen and
LoRA-free, and its log-probs of the sampled response tokens, taken by the same forward as the reference model's (the
micro-batch's layout: padded, packed or shared-prefix; `models.response_logprobs_and_entropy`)."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_ppo.errors import ConfigError
from lit_ppo.plan import StepPlan
from lit_ppo.training.batching import MicroBatch
from lit_ppo.training.models import response_logprobs_and_entropy
from lit_ppo.training.packing import packing_unsupported, shared_prefix_unsupported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_teacher(plan: StepPlan, attn_implementation: str | None = None) -> torch.nn.Module | None:
    """The teacher of `plan.teacher` in eval mode without gradients, with the student's attention kernels (the layout
    is the student's); None without a teacher. A teacher whose model cannot take the run's layout (packed rows, the
    shared prefix) is refused in one line."""
    if plan.teacher is None:
        return None
    from transformers import AutoModelForCausalLM

    attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
    teacher = AutoModelForCausalLM.from_pretrained(plan.teacher.path, dtype=DTYPES[plan.teacher.dtype], **attention)
    teacher = teacher.eval().requires_grad_(False)
    attention_used = teacher.config._attn_implementation
    if plan.layout.packing and (reason := packing_unsupported(teacher.config.model_type, attention_used)):
        raise ConfigError(f"model.teacher.path={plan.teacher.path} with ppo.packing: {reason}; fix: ppo.packing=false")
    if plan.layout.shared_prefix and (reason := shared_prefix_unsupported(teacher.config, attention_used)):
        raise ConfigError(
            f"model.teacher.path={plan.teacher.path} with ppo.shared_prefix: {reason}; fix: ppo.shared_prefix=false"
        )
    return teacher


@torch.no_grad()
def teacher_logprobs(teacher: torch.nn.Module, mb: MicroBatch, temperature: float) -> Tensor:
    """The teacher's log-probs of the micro-batch's response tokens, [B, T] in float32 (zero off the response mask when
    packed), at the sampling temperature as every log-prob of the run (the student's it is compared with)."""
    return response_logprobs_and_entropy(teacher, mb, temperature)[0]
