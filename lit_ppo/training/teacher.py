"""On-policy distillation's teacher in the training process (`model.teacher.where=trainer`): loaded once, frozen and
LoRA-free, and its log-probs of the sampled response tokens, taken by the same forward as the reference model's (the
micro-batch's layout: padded, packed or shared-prefix; `models.response_logprobs_and_entropy`). A teacher on a vLLM
server (`model.teacher.where=<url>`) is its client instead (lit_ppo/training/teacher_server.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_ppo import preemption
from lit_ppo.context_share import shared_by_group
from lit_ppo.errors import ConfigError
from lit_ppo.plan import StepPlan
from lit_ppo.training.batching import MicroBatch
from lit_ppo.training.context_parallel import logprobs_and_entropy
from lit_ppo.training.packing import packing_unsupported, shared_prefix_unsupported
from lit_ppo.training.teacher_server import TeacherServer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_teacher(plan: StepPlan, attn_implementation: str | None = None) -> torch.nn.Module | TeacherServer | None:
    """The teacher of `plan.teacher` in eval mode without gradients, with the student's attention kernels (the layout
    is the student's), or the client of its server; None without a teacher. A teacher whose model cannot take the
    run's layout (packed rows, the shared prefix) is refused in one line."""
    if plan.teacher is None:
        return None
    if plan.teacher.on_server:
        return TeacherServer(plan.teacher.where)
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
def teacher_logprobs(teacher: torch.nn.Module, mb: MicroBatch, temperature: float, cp=None) -> Tensor:
    """The teacher's log-probs of the micro-batch's response tokens, [B, T] in float32 (zero off the response mask when
    packed), at the teacher's scoring temperature (`TeacherPlan.temperature`: by default the sampling one, as every
    log-prob of the run); under context parallelism (`cp`, a `context_parallel.ContextGroup`) the group's forward."""
    return logprobs_and_entropy(teacher, mb, temperature, cp)[0]


def server_teacher_logprobs(teacher, batch, width: int, device, topology) -> Tensor | None:
    """A server teacher's log-probs of the whole rollout batch's response tokens, [N, width] float32, asked before the
    experience forwards in an interruptible region (a signal cuts the wait for the server: None then; the caller's stop
    point stops the run); None for an in-process teacher (its forward runs per micro-batch) or none. With C > 1 the
    context-parallel group's rank 0 alone asks, and its answer is the group's (`context_share.shared_by_group`): the
    server's last bits may differ between answers (vLLM is not batch-invariant), and the ranks of a group must compute
    the same loss for their gradients to add up to the one-rank gradient."""
    if not isinstance(teacher, TeacherServer):
        return None

    def ask() -> Tensor | None:  # on the CPU: a pickled CUDA tensor would arrive on rank 0's GPU
        return preemption.interruptibly(
            lambda: teacher.batch_logprobs(batch.prompt_ids, batch.response_ids, width, "cpu")
        )

    logp = shared_by_group(topology, device, ask)
    return None if logp is None else logp.to(device)
