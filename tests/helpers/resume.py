"""A run's state compared with another's: its counters, its weights (bitwise: CPU, fixed seeds, one process and the
same thread count), and a crash after a given rollout step. Used by the resume tests (tests/test_resume.py,
test_preemption.py, tests/rollout/test_dynamic_sampling.py, test_async.py)."""

from __future__ import annotations

import lightning as L
import torch


def counters(module) -> dict:
    return {
        "rollout_step": module.rollout_step,
        "actor": module.actor_optimizer_steps,
        "critic": module.critic_optimizer_steps,
        "samples": module.samples_seen,
    }


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        # CPU, fixed seeds, one process and the same thread count: the runs are bitwise identical.
        assert torch.equal(a[name], b[name]), name


class Crash(Exception):
    pass


class CrashAfter(L.Callback):
    """Ends the process's training abruptly after a given rollout step, as a crash would."""

    def __init__(self, rollout_step: int):
        self.rollout_step = rollout_step

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if module.rollout_step == self.rollout_step:
            raise Crash()
