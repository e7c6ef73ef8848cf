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


def apply_learning_rates(optimizers: list, schedulers: list, learning_rates: list[float]) -> None:
    """Each schedule's base learning rate set to this run's (`ppo.actor_lr`, `ppo.critic_lr`), at the schedule's
    position: a resumed run restores the checkpoint's optimizer and schedule states, which hold the rates the
    checkpoint was written with, and a changed rate (the fix NonFiniteUpdatesError names) would otherwise be ignored."""
    for optimizer, scheduler, lr in zip(optimizers, schedulers, learning_rates):
        scheduler.base_lrs = [lr] * len(optimizer.param_groups)
        factors = [schedule(scheduler.last_epoch) for schedule in scheduler.lr_lambdas]
        scheduler._last_lr = [lr * f for f in factors]
        for group, now in zip(optimizer.param_groups, scheduler._last_lr):
            group["initial_lr"], group["lr"] = lr, now


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
        self.applied = 0  # updates applied (in this process: an exception checkpoint counts a step's)

    def __call__(self, model: torch.nn.Module, optimizer, scheduler, rollout_step: int) -> float:
        """The gradient's norm before clipping (NaN when the update was skipped)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a sharded DTensor
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if math.isfinite(grad_norm):
            optimizer.step()
            self.consecutive = 0
            self.applied += 1
        else:
            self.skipped += 1
            self.consecutive += 1
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteUpdatesError(
                f"rollout step {rollout_step + 1}: {self.consecutive} optimizer steps in a row had a non-finite loss or "
                f"gradient ({self.skipped} skipped in all); the checkpoint of the step's start was saved; fix: lower "
                "ppo.actor_lr (ppo.critic_lr for the critic's), then resume=auto; or check the rewards"
            )
        return grad_norm if math.isfinite(grad_norm) else float("nan")


class ModuleOptimizers:
    """PPOModule's optimizers (a mixin: reads the module's actor, critic, settings, plan and guarded step): one AdamW
    and schedule per trained model, and one guarded, counted optimizer step of each."""

    def configure_optimizers(self):
        return actor_critic_optimizers(self.actor, self.critic, self.ppo, self.plan)

    def optimizers_and_schedulers(self) -> tuple[list, list]:
        """The actor's optimizer and learning-rate scheduler, then the critic's when the run has one."""
        optimizers, schedulers = self.optimizers(), self.lr_schedulers()
        listed = [x if isinstance(x, list) else [x] for x in (optimizers, schedulers)]
        return listed[0], listed[1]

    def optimizer_steps(self) -> dict[str, float]:
        """One optimizer step of the actor and one of the critic (if any), each skipped on a non-finite loss or gradient
        (`GuardedStep`) and counted; their gradient norms."""
        optimizers, schedulers = self.optimizers_and_schedulers()
        norms = {"actor/grad_norm": self.guarded_step(self.actor, optimizers[0], schedulers[0], self.rollout_step)}
        self.actor_optimizer_steps += 1
        if self.critic is not None:
            norms["critic/grad_norm"] = self.guarded_step(self.critic, optimizers[1], schedulers[1], self.rollout_step)
            self.critic_optimizer_steps += 1
        return norms
