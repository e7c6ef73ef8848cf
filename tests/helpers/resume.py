"""A run's state compared with another's: its counters, its weights (bitwise: CPU, fixed seeds, one process and the
same thread count), and a crash after a given rollout step. Used by the resume tests (tests/test_resume.py,
test_preemption.py, tests/rollout/test_dynamic_sampling.py, test_async.py). `random_kills`: the one harness that
kills a `train.py` run and resumes it (bench/random_kills.py, loaded by its path)."""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import io
import os
import sys
from pathlib import Path

import lightning as L
import torch

_spec = importlib.util.spec_from_file_location("random_kills", Path(__file__).parents[2] / "bench" / "random_kills.py")
random_kills = importlib.util.module_from_spec(_spec)
sys.modules["random_kills"] = random_kills  # its dataclasses look their module up there
_spec.loader.exec_module(random_kills)


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


def checkpointed_run(
    paths, engine, out: Path, *, every: int, keep: int, callbacks=(), crash_after=None, resume_from=None, **build
):
    """A small in-process run (tests.helpers.build_run on `paths` = (model dir, prompt files)) that writes its
    checkpoints into out/checkpoints (`every`, `keep`), fitted from `resume_from` (a checkpoint, or None) after the
    seed a fresh process sets; with `crash_after`, it crashes after that rollout step (CrashAfter: Crash expected).
    `callbacks`: more callbacks, or a function of the checkpoint callback giving them. (trainer, module, datamodule)."""
    import pytest

    from lit_ppo.checkpoints import RolloutCheckpoint
    from tests.helpers import build_run

    checkpoints = RolloutCheckpoint(out / "checkpoints", every=every, keep=keep)
    more = list(callbacks(checkpoints) if callable(callbacks) else callbacks)
    more += [CrashAfter(crash_after)] if crash_after else []
    trainer, module, datamodule, _ = build_run(paths[0], engine, paths[1], out, callbacks=[checkpoints, *more], **build)
    torch.manual_seed(0)
    ckpt = str(resume_from) if resume_from else None
    if crash_after:
        with pytest.raises(Crash):
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=False)
    else:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=False)
    return trainer, module, datamodule


class NonFiniteLossesFrom(L.Callback):
    """Makes every loss non-finite from the run's optimizer step `optimizer_step` on (counted over the run, from 0),
    as a learning rate that diverges would: `lit_ppo.algorithms.aggregate_loss` (through `monkeypatch`) multiplied by
    NaN once the module it watches has taken that many actor optimizer steps. A callback of the run that fails."""

    def __init__(self, monkeypatch, optimizer_step: int):
        from lit_ppo import algorithms  # the losses' aggregation, where lit_ppo.training.loss reads it

        self.module = None
        original = algorithms.aggregate_loss

        def aggregate_loss(*args, **kwargs):
            value = original(*args, **kwargs)
            diverged = self.module is not None and self.module.actor_optimizer_steps >= optimizer_step
            return value * float("nan") if diverged else value

        monkeypatch.setattr(algorithms, "aggregate_loss", aggregate_loss)

    def on_train_start(self, trainer, module) -> None:
        self.module = module

    def on_train_end(self, trainer, module) -> None:
        self.module = None

    def on_exception(self, trainer, module, exception) -> None:
        self.module = None


def recording_datamodule(mismatch_at: int | None = None):
    """A RolloutDataModule class that records every rollout batch it produces (`batches`: of this class alone, one class
    per run) and, at rollout step `mismatch_at`, hands the trainer vLLM log-probs 2 nats off, as a weight sync that
    failed would: the trainer's check (rollout.max_logprob_abs_diff) then stops the step with RolloutMismatchError."""
    from lit_ppo.rollout.datamodule import RolloutDataModule

    class Recording(RolloutDataModule):
        batches: list = []

        def produce_rollout(self, rollout_step):
            batch = super().produce_rollout(rollout_step)
            if rollout_step == mismatch_at:
                batch = dataclasses.replace(
                    batch, rollout_logprobs=[[x - 2.0 for x in logprobs] for logprobs in batch.rollout_logprobs]
                )
            type(self).batches.append(batch)
            return batch

    Recording.batches = []
    return Recording


def assert_same_adapter(one, two, rel: float = 1e-5) -> dict:
    """The final adapters (actor/) of two runs agree within `rel` of the adapter's norm (all its tensors together), and
    have trained; returns the first. In norm, not entry by entry: Adam moves an entry whose gradient is float32 rounding
    (lora_A's, while lora_B is still near its zero start) by up to the learning rate. One process against itself with
    micro-batches of 16 instead of 32 samples: 5.3e-6; 2 ranks against 1: 2.3e-6 (before the global mini-batches, with
    two mini-batches per PPO epoch: 0.35)."""
    from safetensors.torch import load_file

    a = load_file(one / "actor" / "adapter_model.safetensors")
    b = load_file(two / "actor" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("lora_B" in k and float(v.abs().max()) > 0 for k, v in a.items())
    difference = sum(float((b[k] - a[k]).norm()) ** 2 for k in a) ** 0.5
    norm = sum(float(v.norm()) ** 2 for v in a.values()) ** 0.5
    assert difference <= rel * norm, f"the adapters differ by {difference / norm:.2e} of their norm"
    return a


def write_checkpoint(path: Path, weights: int = 1000) -> Path:
    """A checkpoint file with Lightning's and lit-ppo's keys around `weights` float32 zeros and no model, written as a
    run writes one (`CheckpointFile`): for what is decided from the file before any model loads."""
    from lit_ppo.checkpoints import CheckpointFile

    path.parent.mkdir(parents=True, exist_ok=True)
    CheckpointFile().save_checkpoint({"state_dict": {"w": torch.zeros(weights)}, "lit_ppo": {}}, path)
    return path


class FullDisk(io.FileIO):
    """A file on a disk with `room` bytes left: a write past them writes what fits and fails with ENOSPC, as the
    kernel's does (`written` counts what reached the file)."""

    def __init__(self, path, mode: str, room: int):
        super().__init__(path, mode.replace("b", ""))
        self.room, self.written = room, 0

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.room:
            self.written += super().write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        self.written += len(data)
        return super().write(data)


def full_disk_open(name: str, room: int = 4096, opened: list | None = None):
    """An `open` for a module that writes checkpoints (lit_ppo.checkpoints): the file `name` is written on a disk with
    `room` bytes left (`FullDisk`, appended to `opened`); any other file is opened as it is."""

    def full_disk(path, mode="r", *args, **kwargs):
        if Path(path).name == name:
            file = FullDisk(path, mode, room)
            if opened is not None:
                opened.append(file)
            return file
        return open(path, mode, *args, **kwargs)

    return full_disk
