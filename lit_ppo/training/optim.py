"""Optimizers and the guarded optimizer step of the actor and the critic."""

from __future__ import annotations

import math

import torch

from lit_ppo import algorithms as algo
from lit_ppo.config import PPOConfig
from lit_ppo.errors import NonFiniteUpdatesError
from lit_ppo.plan import StepPlan


def adamw_with_schedule(model: torch.nn.Module, lr: float, ppo: PPOConfig, plan: StepPlan):
    """AdamW and its LR schedule (warm-up, then constant or cosine), stepped once per optimizer step: the plan's
    `lr_total_steps` is the schedule's length. Returns Lightning's (optimizer, scheduler config)."""
    # Only what trains: with LoRA the frozen base has no gradients and gets no AdamW states.
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=ppo.weight_decay)
    schedule = algo.lr_lambda(plan.counts.lr_warmup_steps, plan.counts.lr_total_steps, ppo.lr_schedule)
    return optimizer, {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), "interval": "step"}


def actor_critic_optimizers(actor: torch.nn.Module, critic: torch.nn.Module | None, ppo: PPOConfig, plan: StepPlan):
    """Lightning's `configure_optimizers` answer: the actor's optimizer and schedule, then the critic's if it exists."""
    models = [(actor, ppo.actor_lr)] + ([(critic, ppo.critic_lr)] if critic is not None else [])
    pairs = [adamw_with_schedule(model, lr, ppo, plan) for model, lr in models]
    return [optimizer for optimizer, _ in pairs], [schedule for _, schedule in pairs]


class GuardedStep:
    """Clip and apply one update; a non-finite gradient skips it (counted) instead of corrupting the weights, and
    `max_consecutive` skipped in a row stop the run. The scheduler steps either way: its length is the plan's."""

    def __init__(self, max_grad_norm: float, max_consecutive: int):
        self.max_grad_norm = max_grad_norm
        self.max_consecutive = max_consecutive
        self.skipped = 0  # in all (checkpointed by the module)
        self.consecutive = 0

    def __call__(self, model: torch.nn.Module, optimizer, scheduler, rollout_step: int) -> float:
        """The gradient's norm before clipping (NaN when the update was skipped)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a sharded DTensor
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if math.isfinite(grad_norm):
            optimizer.step()
            self.consecutive = 0
        else:
            self.skipped += 1
            self.consecutive += 1
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteUpdatesError(
                f"rollout step {rollout_step + 1}: {self.consecutive} optimizer steps in a row had a non-finite loss or "
                f"gradient ({self.skipped} skipped in all); a checkpoint was saved; fix: lower ppo.actor_lr/critic_lr "
                "or check the rewards, then resume=auto"
            )
        return grad_norm if math.isfinite(grad_norm) else float("nan")
