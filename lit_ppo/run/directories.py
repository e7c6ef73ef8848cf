"""The run's directories, checked writable before anything is written into them: `output_dir` before Hydra makes it
(`RunDirectoryCheck`, a Hydra callback: Hydra creates the run directory before `train.py:main` runs, with a traceback
when it cannot), and `<output_dir>/checkpoints` before any model loads (`run/entry.py:main`): Lightning's atomic save
swallows a PermissionError, and the run would fail after its first checkpointed rollout step with a FileNotFoundError.

Imports nothing heavy: Hydra instantiates the callback for every run, before torch loads (lit_ppo/run/threads.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lit_ppo.atomic import directory_problem
from lit_ppo.errors import DirectoryError
from lit_ppo.run.lock import hold_until_exit


def check_writable(directory: Path, what: str, fix: str) -> None:
    """A DirectoryError naming `what` (the setting and its value), the real reason and `fix` when files cannot be
    written into `directory`."""
    problem = directory_problem(directory)
    if problem:
        raise DirectoryError(f"{what}: {problem}; fix: {fix}")


def check_run_directories(output_dir: Path, key: str, training: bool) -> None:
    """The run's directory (`key`: the setting that named it) and, for a training run, its checkpoints/ (which a link
    or an earlier run may have put elsewhere, or left read-only)."""
    check_writable(
        output_dir, f"{key}={output_dir}", f"set {key} to a directory this user can write, or make it writable"
    )
    checkpoints = Path(output_dir) / "checkpoints"
    if training and checkpoints.exists():
        check_writable(
            checkpoints, f"the checkpoints of {key}={output_dir}", f"make it writable, or give the run another {key}"
        )


class RunDirectoryCheck(Callback):
    """Registered in conf/config.yaml under hydra.callbacks: an output_dir (Hydra's run directory) that cannot be
    written, or that another run holds (lit_ppo/run/lock.py), is refused in one line, exit 2, before Hydra makes it
    or writes its files into it; else its lock is held until the process exits."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            run_dir = OmegaConf.select(config, "hydra.run.dir")
        except Exception:  # an interpolation only Hydra resolves: its own mkdir will tell
            return
        if not run_dir:
            return
        key = "output_dir" if config.get("output_dir") else "hydra.run.dir"
        try:
            check_run_directories(Path(str(run_dir)), key, training=str(config.get("mode")) == "train")
            lock = hold_until_exit(Path(str(run_dir)), key)
        except DirectoryError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        if lock is not None and lock.note:  # before run.log is opened: run/entry.py:run writes it there
            print(lock.note, flush=True)
