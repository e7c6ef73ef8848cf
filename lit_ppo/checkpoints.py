"""Checkpoints every `checkpoint_every` rollout steps, written atomically, keeping the last K.

A checkpoint is written to `<name>.tmp` beside it and renamed into place, so a crash during the write
(out of memory, SIGKILL, a preempted node) leaves the previous checkpoints intact; stale
`.tmp` files are never read back, and a write that fails (a full disk) removes its own. A checkpoint is read before
any model loads (lit_ppo/resume.py, which also chooses what a run resumes from): `resume=auto` passes over one cut
short, to the newest intact one.

A checkpoint is not bound to the number of ranks that wrote it: it holds full (unsharded) weights and optimizer
states (DDP's are replicated; under FSDP2 Lightning's ModelParallelStrategy gathers them with
`torch.distributed.checkpoint.state_dict`'s full-state options and, on load, scatters them to the new ranks' shards),
the data position and the sampling seeds are global (a prompt's seed follows its position in the rollout batch), and
every rank's random streams are kept (`rank_states`). A run resumes on any number of ranks
(`resume.RESHARD_KEYS`); on the same number it continues bitwise, each rank with its own streams. What the module
adds to a checkpoint (its counters, histories and random streams, `module_state`, `rank_states`) and the checks of
the checkpoint's plan against the resumed run's are beside the module, in lit_ppo/training/state.py.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_ppo import waits
from lit_ppo.atomic import (
    FULL,
    directory_problem,
    replace_durably,
    space_problem,
    temporary_sibling,
)
from lit_ppo.console import show
from lit_ppo.errors import (
    DirectoryError,
    DynamicSamplingShortfallError,
    NonFiniteUpdatesError,
    RolloutMismatchError,
)

# `rollout_step_000004.ckpt`: a name without `=`, so that `resume=<run>/checkpoints/<name>` is one Hydra override as
# written. Checkpoints of earlier versions, `rollout_step=000004.ckpt`, are still found and loaded (`resume=auto`, or
# the path quoted for Hydra: `'resume="<run>/checkpoints/rollout_step=000004.ckpt"'`).
_NAME = re.compile(r"^rollout_step[_=](\d+)\.ckpt$")
DAMAGED_SUFFIX = ".damaged"  # a checkpoint resume=auto passed over, renamed aside (no longer a checkpoint's name)


def checkpoint_path(directory: Path, rollout_step: int) -> Path:
    return Path(directory) / f"rollout_step_{rollout_step:06d}.ckpt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


class CheckpointFile(TorchCheckpointIO):
    """Lightning's checkpoint writer, writing the file straight to the path it is given (`save_atomic`'s
    `<name>.ckpt.tmp`, beside the checkpoint). Lightning's own staged every checkpoint in memory and then in the
    system's temporary directory (fsspec's transaction), so a small `$TMPDIR` failed checkpoints where the run's
    directory had room, and a full disk left its partial copy behind."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("CheckpointFile.save_checkpoint takes no storage_options (a local file only)")
        with open(path, "wb") as f:
            torch.save(checkpoint, f)


def save_atomic(trainer: L.Trainer, path: Path, *, rank_zero: bool) -> Path:
    """The trainer's checkpoint at `path`, written under a temporary name beside it and renamed; a write that fails
    removes its partial file. A collective: every rank calls it, and where rank 0 cannot write the file (a directory
    it may not write, a full disk) every rank raises the same DirectoryError (a rank that went on would wait for rank
    0 in its next collective until the process group's timeout). `rank_zero`: whether this is rank 0, which writes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    unwritten = None
    try:
        # Every rank takes part (sharded states); rank 0 writes the file; then all meet at Lightning's barrier.
        trainer.save_checkpoint(tmp)
    except Exception as error:  # across file systems, Lightning's atomic save calls a PermissionError an fsspec problem
        if rank_zero:
            tmp.unlink(missing_ok=True)  # a partial file, not left on a full disk
        reason = rank_zero and (directory_problem(path.parent) or space_problem(error, path.parent))
        if not reason:
            raise
        trainer.strategy.barrier("Trainer.save_checkpoint")  # the others wait there: the write is its last step
        unwritten = _unwritten(path, reason)
        unwritten.__cause__ = error
    if rank_zero and unwritten is None:
        if not tmp.is_file():  # Lightning's atomic save, on one file system, swallows a PermissionError
            unwritten = _unwritten(path, directory_problem(path.parent) or f"{tmp} was not written")
        else:
            try:
                replace_durably(tmp, path)  # its flush to disk is where a full disk may show first
            except OSError as error:
                tmp.unlink(missing_ok=True)
                unwritten = _unwritten(
                    path, space_problem(error, path.parent) or f"{path.parent}: {error.strerror or error}"
                )
                unwritten.__cause__ = error
    # Rank 0's outcome to every rank (in place of a barrier: a collective all ranks reach, whatever happened).
    problem = trainer.strategy.broadcast(str(unwritten) if unwritten is not None else None, src=0)
    if problem is not None:
        raise unwritten if unwritten is not None else DirectoryError(problem)
    return path


def _unwritten(path: Path, reason: str) -> DirectoryError:
    kept = [p.name for p in list_checkpoints(path.parent) if p != path]
    if len(kept) > 3:
        kept = [f"{len(kept) - 3} older ones", *kept[-3:]]
    kept_note = f"; earlier checkpoints kept: {', '.join(kept)}" if kept else ""
    full = reason.endswith(tuple(FULL.values()))
    fix = f"free space in {path.parent}" if full else f"make {path.parent} writable (or free space there)"
    return DirectoryError(
        f"the checkpoint {path.name} could not be written: {reason}{kept_note}; fix: {fix}, then resume=auto"
    )


def prune(directory: Path, keep: int, newest: Path | None = None) -> None:
    """Keep `keep` checkpoints: `newest` (the one the running run just wrote, whatever its number) and the
    highest-numbered others."""
    if keep <= 0:
        return
    others = [p for p in list_checkpoints(directory) if newest is None or p != Path(newest)]
    for old in others[: len(others) - (keep - 1 if newest is not None else keep)]:
        old.unlink(missing_ok=True)


def step_of(path: Path) -> int | None:
    """The rollout step in a checkpoint's name (this version's or an earlier one's); None for another name (a
    `resume=` path the user named, e.g. start.ckpt)."""
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


STOPPING_ERRORS = (NonFiniteUpdatesError, DynamicSamplingShortfallError, RolloutMismatchError)
"""The errors that stop a run with a checkpoint of the failing step's start (`RolloutCheckpoint.on_exception`), whose
fixes (lit_ppo.resume.REMEDY_KEYS) a resumed run may set."""


class StepStart:
    """What a rollout step moves before it completes, as it was at the step's start: the data module's position
    (`snapshot`: its prompts, and with rollout workers the step taken from them), the random streams, the optimizer
    step counters and the learning-rate schedules' positions. Cheap to take (no tensor of the models): taken at every
    step's start, put back by an exception checkpoint (`RolloutCheckpoint.on_exception`)."""

    def __init__(self, trainer, module):
        self.rollout_step = module.rollout_step
        datamodule = trainer.datamodule
        self.data = datamodule.snapshot() if datamodule is not None else None
        self.rng = rng_state()
        self.shuffle = module.shuffle_generator.get_state()
        self.counters = {k: getattr(module, k) for k in ("actor_optimizer_steps", "critic_optimizer_steps")}
        self.skipped, self.applied = module.guarded_step.skipped, module.guarded_step.applied
        self.schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]

    def updates_applied(self, module) -> int:
        """The optimizer steps the step applied to the models since its start (those a non-finite gradient skipped
        left them as they were)."""
        return module.guarded_step.applied - self.applied

    def put_back(self, trainer, module) -> None:
        if trainer.datamodule is not None:
            trainer.datamodule.restore(self.data)
        restore_rng_state(self.rng)
        module.shuffle_generator.set_state(self.shuffle)
        for k, v in self.counters.items():
            setattr(module, k, v)
        module.guarded_step.skipped = self.skipped
        module.guarded_step.consecutive = 0
        for config, state in zip(trainer.lr_scheduler_configs, self.schedulers):
            config.scheduler.load_state_dict(state)
            for group, lr in zip(config.scheduler.optimizer.param_groups, config.scheduler.get_last_lr()):
                group["lr"] = lr


class RolloutCheckpoint(L.Callback):
    """Saves after every `every` rollout steps and after the last, and on the errors that a setting fixes
    (STOPPING_ERRORS): then the checkpoint of the failing step's start, which a resumed run trains again."""

    def __init__(self, directory: Path, every: int, keep: int):
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.last_saved = -1
        self.step_start: StepStart | None = None

    def save(self, trainer: L.Trainer, module) -> Path | None:
        if module.rollout_step == self.last_saved:
            return None
        waits.entering(f"writing the checkpoint of rollout step {module.rollout_step}")
        path = save_atomic(
            trainer, checkpoint_path(self.directory, module.rollout_step), rank_zero=module.topology.is_rank_zero
        )
        self.last_saved = module.rollout_step
        if module.topology.is_rank_zero:
            prune(self.directory, self.keep, newest=path)
        return path

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.step_start = StepStart(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.step_start = None
        last = module.rollout_step == module.plan.counts.total_rollout_steps
        if last or (self.every and module.rollout_step % self.every == 0):
            # The last step's too, here: a checkpoint written once Lightning's loop has ended (`on_train_end`) records
            # its one epoch as done, and a run extended from it (trainer.total_rollout_steps raised) trained nothing.
            self.save(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        self.save(trainer, module)

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        # The failing step's start, so that a resumed run (with the fix the error names) trains its prompts again: no
        # prompt skipped, the planned optimizer steps. What the models learned before the step is kept; where the
        # step had already applied updates (a divergence after them, a mismatch found after an on-policy update), the
        # weights and the optimizer's moments carry them, and the line below says so.
        if not isinstance(exception, STOPPING_ERRORS) or self.last_saved == module.rollout_step:
            return  # the step's start is on disk already (the previous step's checkpoint)
        start = self.step_start
        if start is not None and start.rollout_step == module.rollout_step:
            applied = start.updates_applied(module)
            start.put_back(trainer, module)
            if applied and module.topology.is_rank_zero:
                show(
                    f"the checkpoint of rollout step {module.rollout_step} holds the models after {applied} of the "
                    f"failing step's optimizer steps (applied before it failed) and the data position, counters and "
                    "learning-rate schedules of its start: a resumed run trains the step's prompts again from them"
                )
        self.save(trainer, module)


def rng_state() -> dict:
    """Torch's, Python's and NumPy's random states, for a resumed run to continue the same streams.

    NumPy's state as plain lists: the checkpoint then loads with torch.load(weights_only=True), which
    Lightning uses when a strategy restores after setup (ModelParallelStrategy) whatever fit() was given."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [v.tolist() if isinstance(v, np.ndarray) else v for v in np.random.get_state()],
    }


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
