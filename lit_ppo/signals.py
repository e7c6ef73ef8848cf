"""Signals outside the rollout steps: before the first (config, pre-flight, model load, engine start) and after the
last (the final writes), SIGTERM, SIGINT and SIGUSR1 end the process with one line and 128 + the signal's number
(`train.py` installs `outside_training` first thing). During the rollout steps `lit_ppo.preemption` handles them
(a checkpoint first). Its own module, importing neither Lightning nor torch: `mode=plan` loads no training library."""

from __future__ import annotations

import signal

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def exit_status(signum: int) -> int:
    """128 + the signal's number: what a shell reports for a process that signal killed."""
    return 128 + int(signum)


class Stopped(SystemExit):
    """The process stopped on a signal outside the rollout steps (`outside_training`); `line` says where."""

    def __init__(self, signum: int, line: str):
        super().__init__(exit_status(signum))
        self.signum, self.line = int(signum), line


# What the process does when no Preemption handles signals: "start-up" until the first `fit` reaches its rollout
# steps, "the final writes" after (the last checkpoint is on disk then).
_phase = "start-up"


def starting() -> None:
    """A run starts in this process (`run.train.train`; a sweep runs several)."""
    global _phase
    _phase = "start-up"


def training_started() -> None:
    """The run's rollout steps began (`preemption.Preemption` handles signals during them); after them, only the
    final writes are left."""
    global _phase
    _phase = "the final writes"


def outside_training(signum: int, frame) -> None:
    """The handler of PREEMPTION_SIGNALS outside the rollout steps: raises `Stopped` (once; later signals are ignored
    while the process unwinds)."""
    for handled in PREEMPTION_SIGNALS:
        signal.signal(handled, signal.SIG_IGN)
    name, status = signal.Signals(signum).name, exit_status(signum)
    if _phase == "start-up":
        line = (
            f"stopped by {name} during start-up (config, pre-flight, model load, engine start), before rollout step 1:"
            f" nothing was trained and no checkpoint written; exiting with status {status} (start the run again)"
        )
    else:
        line = (
            f"stopped by {name} after the last rollout step, while writing the final outputs (actor/, summary.json):"
            f" its checkpoint is on disk; exiting with status {status} (resume=auto writes them)"
        )
    raise Stopped(signum, line)


def handle_signals_outside_training() -> None:
    """Install `outside_training` for PREEMPTION_SIGNALS (from the main thread, at the process's start)."""
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, outside_training)
