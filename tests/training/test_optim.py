"""The optimizers' learning rates on resume (lit_ppo/training/optim.py)."""

from __future__ import annotations

import pytest
import torch

from lit_ppo import algorithms as algo
from lit_ppo.training.optim import apply_learning_rates


def adamw_and_schedule(lr: float):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, algo.lr_lambda(4, 20, "cosine"))


def test_a_learning_rate_changed_on_resume_replaces_the_checkpoints_at_the_schedules_position():
    """A resumed run restores the optimizer's and the schedule's states, which hold the checkpoint's learning rate:
    the fix NonFiniteUpdatesError names (lower ppo.actor_lr, then resume=auto) would train on with the old one.
    `apply_learning_rates` sets the new base rate where the schedule stands, and the schedule goes on from it."""
    model, optimizer, schedule = adamw_and_schedule(1e-3)
    for _ in range(6):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    saved = optimizer.state_dict(), schedule.state_dict()

    _, resumed, resumed_schedule = adamw_and_schedule(1e-4)  # the resumed run's settings
    resumed.load_state_dict(saved[0])  # what Lightning restores
    resumed_schedule.load_state_dict(saved[1])
    factor = algo.lr_lambda(4, 20, "cosine")
    assert resumed.param_groups[0]["lr"] == pytest.approx(1e-3 * factor(6))  # the old rate: the bug
    apply_learning_rates([resumed], [resumed_schedule], [1e-4])
    assert resumed.param_groups[0]["lr"] == pytest.approx(1e-4 * factor(6))
    assert resumed_schedule.get_last_lr() == [resumed.param_groups[0]["lr"]]
    resumed_schedule.step()
    assert resumed.param_groups[0]["lr"] == pytest.approx(1e-4 * factor(7))


def test_an_unchanged_learning_rate_is_left_bitwise_as_restored():
    _, optimizer, schedule = adamw_and_schedule(3e-4)
    for _ in range(5):
        schedule.step()
    before = [g["lr"] for g in optimizer.param_groups]
    apply_learning_rates([optimizer], [schedule], [3e-4])
    assert [g["lr"] for g in optimizer.param_groups] == before
