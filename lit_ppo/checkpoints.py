"""Checkpoints every `checkpoint_every` rollout steps, written atomically, keeping the last K.

A checkpoint is written to `<name>.tmp` beside it and renamed into place, so a crash during the write
(out of memory, SIGKILL, a preempted node) leaves the previous checkpoints intact; stale
`.tmp` files are never read back, and a write that fails (a full disk) removes its own. A checkpoint is read before
any model loads (`checkpoint_problem`): `resume=auto` passes over one cut short, to the newest intact one.

A checkpoint is not bound to the number of ranks that wrote it: it holds full (unsharded) weights and optimizer
states (DDP's are replicated; under FSDP2 Lightning's ModelParallelStrategy gathers them with
`torch.distributed.checkpoint.state_dict`'s full-state options and, on load, scatters them to the new ranks' shards),
the data position and the sampling seeds are global (a prompt's seed follows its position in the rollout batch), and
every rank's random streams are kept (`rank_states`). A run resumes on any number of ranks (`RESHARD_KEYS`); on the
same number it continues bitwise, each rank with its own streams. What the module adds to a checkpoint (its counters,
histories and random streams, `module_state`, `rank_states`) and the checks of the checkpoint's plan against the
resumed run's are beside the module, in lit_ppo/training/state.py.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import random
import re
import zipfile
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
from lit_ppo.config import RunConfig, move_keys
from lit_ppo.console import show
from lit_ppo.errors import (
    ConfigError,
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


class _Anything:
    """Whatever a checkpoint's pickle names (tensors, torch classes, Lightning's objects), read without importing it."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):  # a dict subclass's items (pickle's SETITEMS)
        pass

    def append(self, item):  # a list subclass's items (APPENDS)
        pass

    def extend(self, items):
        pass


class _StateReader(pickle.Unpickler):
    """A torch checkpoint's object record (`data.pkl`) read for its structure only: no class imported, no storage
    read (a tensor is `_Anything`), so a checkpoint of any size is checked in the time of its small record."""

    def find_class(self, module, name):
        return collections.OrderedDict if (module, name) == ("collections", "OrderedDict") else _Anything

    def persistent_load(self, pid):
        return None


def checkpoint_problem(path: Path) -> str | None:
    """Why the file at `path` cannot be resumed from, in words (cut short or damaged inside, or not a lit-ppo
    checkpoint), or None. Read before any model loads, and cheaply: a checkpoint is a zip archive (torch.save's),
    whose directory is at its end, so a file cut short (by a full disk, a killed copy) has none; then its object
    record, for lit-ppo's own state. A file that cannot be read at all (permissions, a file system's error) is no
    damaged checkpoint: that is refused in one line (DirectoryError), never passed over for an older one."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            record = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if record is None:
                return f"{path.name} is damaged: its zip archive holds no object record (data.pkl)"
            state = _StateReader(io.BytesIO(archive.read(record))).load()
    except zipfile.BadZipFile as e:
        size = path.stat().st_size
        if "directory" in str(e) or "not a zip file" in str(e).lower():
            return (
                f"{path.name} is damaged: its {size} bytes end without the zip directory a checkpoint ends with (cut "
                "short, by a full disk or a killed copy?)"
            )
        return f"{path.name} is damaged ({e})"
    except FileNotFoundError:  # set aside by rank 0 (`resolve_resume`) while another rank looked: passed over there too
        return f"{path.name} is gone (set aside as damaged, or removed, while it was read)"
    except OSError as e:
        raise DirectoryError(
            f"{path}: cannot be read ({e.strerror or type(e).__name__}): not a damaged checkpoint as far as can be told, "
            "so no older one is resumed in its place; fix: make it readable (its permissions, the file system) and start "
            "again"
        ) from None
    except Exception as e:  # the object record cut short or garbled inside: damaged
        return f"{path.name} is damaged ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''})"
    if not isinstance(state, dict) or not {"state_dict", "lit_ppo"} <= state.keys():
        holds = f"the keys {sorted(map(str, state))[:6]}" if isinstance(state, dict) else f"a {type(state).__name__}"
        return (
            f"{path.name} is not a lit-ppo checkpoint (it holds {holds}, no 'lit_ppo' state: another program's file?)"
        )
    return None


def resolve_resume(resume: str | None, directory: Path, announce: bool = False) -> Path | None:
    """`null`: start fresh; `auto`: the newest checkpoint in the run's directory that can be resumed from
    (`checkpoint_problem`), if any, passing over newer ones that cannot (with one warning line where `announce`: a
    requeued job would otherwise fail on the same file on every start); else a path, refused in one line where it
    cannot be resumed from, naming the checkpoint to resume from instead."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        passed_over, damaged = [], []
        for path in reversed(list_checkpoints(directory)):
            problem = checkpoint_problem(path)
            if problem is None:
                if passed_over and announce:  # rank 0: set aside, so that the rotation keeps intact ones and a
                    # requeued job does not pass over it again (renamed, never deleted: the user may want it)
                    for other in damaged:
                        other.rename(other.with_name(other.name + DAMAGED_SUFFIX))
                    show(
                        f"warning: resume=auto: {'; '.join(passed_over)}; set aside as <name>{DAMAGED_SUFFIX}; "
                        f"resuming from {path.name}, the newest intact checkpoint (the rollout steps after "
                        f"{step_of(path)} are trained again)"
                    )
                return path
            passed_over.append(problem)
            damaged.append(path)
        if passed_over:
            shown = "; ".join(passed_over[:3]) + (f"; and {len(passed_over) - 3} more" if len(passed_over) > 3 else "")
            raise ConfigError(
                f"resume=auto: no checkpoint in {directory} can be resumed from: {shown}; fix: put an intact "
                "checkpoint there, or start a new run in another output_dir"
            )
        return None
    path = Path(resume)
    if not path.is_file():
        raise ConfigError(f"resume={resume}: no such checkpoint file; fix: give a .ckpt path or resume=auto")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"resume={resume}: {problem}; fix: {_instead(path, Path(directory))}")
    return path


def _instead(path: Path, directory: Path) -> str:
    """The resume that continues from the newest intact checkpoint beside `path` (a damaged one)."""
    for other in reversed(list_checkpoints(path.parent)):
        if other != path and checkpoint_problem(other) is None:
            if path.parent.resolve() == directory.resolve():
                return f"resume=auto, which resumes from {other.name}, the newest intact checkpoint in {directory}"
            return f"resume={other}, the newest intact checkpoint beside it"
    return "resume from another checkpoint of this run, or start a new run in another output_dir"


def fresh_start_note(resume: str | None, output_dir: Path) -> str | None:
    """The line a run with `resume=auto` prints when its directory holds no checkpoint (it then starts at rollout step
    0), saying whether an earlier run wrote there at all (a misspelt output_dir) or stopped before its first
    checkpoint; None otherwise. Read before this run writes its own config.yaml."""
    if resume != "auto" or list_checkpoints(Path(output_dir) / "checkpoints"):
        return None
    if (Path(output_dir) / "config.yaml").is_file():
        found = "holds a run that stopped before its first checkpoint"
    else:
        found = "holds no earlier run (is it the directory of the run to continue?)"
    return (
        f"resume=auto: no checkpoint in {Path(output_dir) / 'checkpoints'}; output_dir={output_dir} {found}; "
        "starting at rollout step 0"
    )


def finished_note(
    resume: str | None, checkpoint: Path | None, total_rollout_steps: int, output_dir: Path
) -> str | None:
    """The line a resumed run prints instead of training when its checkpoint is at or past the run's length and the
    run that wrote it finished there (its summary.json counts the same rollout steps); None when there is something
    left to do. A run killed after its last checkpoint but before its final files is not finished: it resumes, and
    writes them."""
    if checkpoint is None:
        return None
    step = step_of(checkpoint)
    summary = Path(output_dir) / "summary.json"
    if step is None or step < total_rollout_steps or not summary.is_file():
        return None
    try:
        finished_at = json.loads(summary.read_text()).get("rollout_steps")
    except (OSError, ValueError):
        return None
    if finished_at != step:
        return None
    where = (
        f"the end of the run (rollout step {step} of {total_rollout_steps})"
        if step == total_rollout_steps
        else f"rollout step {step}, past the run's length of {total_rollout_steps} rollout steps"
    )
    return (
        f"resume={resume}: {checkpoint.name} is at {where}, and its run finished there ({summary.name}); nothing to "
        "train, exiting; to train longer, raise trainer.total_rollout_steps (or trainer.data_epochs)"
    )


RUN_LENGTH_KEYS = (
    "trainer.total_rollout_steps",
    "trainer.data_epochs",
)
"""What a resumed run may change about the run itself: how long it goes on."""

RESHARD_KEYS = (
    "strategy.devices",
    "strategy.num_nodes",
    "strategy.lightning.data_parallel_size",
)
"""The number of ranks, which a resumed run may change too (a run moved from 8 GPUs to 4, a requeued job on another
node count): the checkpoint's states are full ones, resharded on load."""

REMEDY_KEYS = (
    "ppo.actor_lr",
    "ppo.critic_lr",
    "ppo.dynamic_sampling.max_generation_rounds",
    "ppo.dynamic_sampling.on_shortfall",
    "rollout.max_logprob_abs_diff",
    "rollout.episodes.check_token_ids",
)
"""The settings that the errors which stop a run with a checkpoint name as their fix ("..., then resume=auto":
NonFiniteUpdatesError, DynamicSamplingShortfallError, RolloutMismatchError): a resumed run may change them, with one
warning line each (`remedy_changes`). Learning rates take effect from the resumed run's first optimizer step
(`training.optim.apply_learning_rates`), the others where they are read, every rollout step."""

UNTRACKED_KEYS = (
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.collective_timeout_s",
    "rollout.engine_start_timeout_s",
    "rollout.workers.server_urls",  # where the vLLM servers run (a requeued job gets new ones), not what they serve
    "rollout.workers.trainer_host",  # where the trainer runs (a requeued job may land on another node)
    "rollout.workers.port",
    "resume",
    "output_dir",
    "cache_dir",
    "verbose",
    "mode",
    "logger",
)
"""Keys (or key prefixes) that change what is recorded or where, not what is trained: free on resume too."""


CHANGEABLE_KEYS = RUN_LENGTH_KEYS + RESHARD_KEYS + UNTRACKED_KEYS + REMEDY_KEYS


def _is_among(key: str, keys: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def _flat(config, prefix: str = "") -> dict:
    if isinstance(config, dict):
        flat = {}
        for key, value in config.items():
            flat.update(_flat(value, f"{prefix}{key}."))
        return flat or {prefix[:-1]: {}}
    return {prefix[:-1]: config}


def config_differences(saved: dict, current: dict) -> list[str]:
    """`key: saved -> current` for every key that differs between two configs (`RunConfig.to_dict()`s), except the
    run length and the keys that do not change the training."""
    a, b = _flat(saved), _flat(current)
    return [
        f"{key}: {a.get(key, '(absent)')} -> {b.get(key, '(absent)')}"
        for key in sorted(a.keys() | b.keys())
        if a.get(key, _MISSING) != b.get(key, _MISSING) and not _is_among(key, CHANGEABLE_KEYS)
    ]


def remedy_changes(saved: dict, current: dict) -> list[str]:
    """One warning line per REMEDY_KEYS setting that a resumed run changes, with its old and new values."""
    a, b = _flat(saved), _flat(current)
    return [
        f"resume: {key} changed from {a.get(key, '(absent)')} to {b.get(key, '(absent)')} (the fix an error named); "
        "the resumed run trains with the new value"
        for key in REMEDY_KEYS
        if a.get(key, _MISSING) != b.get(key, _MISSING)
    ]


_MISSING = object()


def check_run_directory(config: RunConfig, output_dir: Path) -> None:
    """One run per directory, checked before anything is written into it: a fresh run (`resume` unset) refuses a
    directory that holds checkpoints, and a resumed run refuses a checkpoint written under another config (but
    for the run length) or older than the directory's latest. Rotation keeps the highest step numbers, so a second
    run in the same directory would otherwise lose its own checkpoints and `resume=auto` pick up the first run's."""
    import yaml

    directory = Path(output_dir) / "checkpoints"
    found = list_checkpoints(directory)
    resume = config.resume
    if resume in (None, "", "none"):
        if found:
            raise ConfigError(
                f"output_dir={output_dir} already holds another run's checkpoints (latest {found[-1].name}); "
                "fix: resume=auto to continue that run, or give this run another output_dir"
            )
        return
    path = resolve_resume(resume, directory)
    if path is None:
        return
    named = step_of(path)
    if resume != "auto" and path.parent.resolve() == directory.resolve() and named is not None:
        # (a newer one that cannot be resumed from does not count: resume=auto would pass it over too)
        newer = [p for p in found if step_of(p) > named and checkpoint_problem(p) is None]
        if newer:
            raise ConfigError(
                f"resume={resume} is older than {newer[-1].name} in the same directory, whose rotation would then mix "
                f"two runs; fix: resume=auto, or resume into another output_dir"
            )
    saved_config = path.parent.parent / "config.yaml"  # <run>/checkpoints/<file>.ckpt: its run's config
    if path.parent.name != "checkpoints" or not saved_config.is_file():
        return
    saved = move_keys(yaml.safe_load(saved_config.read_text()), announce=False)  # flat rollout keys of a run before
    differences = config_differences(saved, config.to_dict())
    saved_strategy = _flat(saved).get("strategy.name")
    if saved_strategy is not None and saved_strategy != config.strategy.name:
        # The strategy group's other keys (strategy.lightning.*) follow from its name: the user's setting is the name.
        others = [d for d in differences if not d.startswith("strategy.")]
        also = f", nor {'; '.join(others[:6])}" + (f"; and {len(others) - 6} more" if len(others) > 6 else "")
        raise ConfigError(
            f"resume={resume}: {path.name} was written under strategy={saved_strategy}, this run is "
            f"strategy={config.strategy.name}; the strategy may not change on resume (the number of ranks may)"
            f"{also if others else ''}; fix: resume with {strategy_for_resume(saved_strategy, config.strategy)}"
            f"{f' and the values in {saved_config}' if others else ''}, or start a new run in another output_dir"
        )
    if differences:
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        raise ConfigError(
            f"resume={resume}: {path.name} was written under another config ({shown}); only the run length "
            f"({', '.join(RUN_LENGTH_KEYS)}), the number of ranks ({', '.join(RESHARD_KEYS[:2])}) and the fixes "
            f"errors name ({', '.join(REMEDY_KEYS)}) may change on resume; fix: resume with the values in "
            f"{saved_config}, or start a new run in another output_dir"
        )
    for line in remedy_changes(saved, config.to_dict()):
        show(line)


def strategy_for_resume(saved_strategy: str, strategy) -> str:
    """The command-line settings that resume a checkpoint of `saved_strategy` on this run's ranks (`strategy`'s
    devices and nodes): one process when the checkpoint's strategy is single."""
    if saved_strategy == "single":
        return "strategy=single strategy.devices=1"
    nodes = f" strategy.num_nodes={strategy.num_nodes}" if strategy.num_nodes > 1 else ""
    return f"strategy={saved_strategy} strategy.devices={strategy.devices}{nodes}"


STOPPING_ERRORS = (NonFiniteUpdatesError, DynamicSamplingShortfallError, RolloutMismatchError)
"""The errors that stop a run with a checkpoint of the failing step's start (`RolloutCheckpoint.on_exception`), whose
fixes (REMEDY_KEYS) a resumed run may set."""


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
