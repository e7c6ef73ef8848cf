"""Signals outside the rollout steps: before the first (config, pre-flight, model load, engine start) and after the
last (the final writes), SIGTERM, SIGINT and SIGUSR1 end the process with one line and 128 + the signal's number
(`train.py` installs `outside_training` first thing, before its imports). During the rollout steps `lit_ppo.preemption`
handles them (a checkpoint first). Its own module, importing neither Lightning nor torch: `mode=plan` loads no training
library, and `train.py` installs the handler before its seconds of imports (Hydra, tqdm).

A KeyboardInterrupt is only ever Python's answer to SIGINT under its default handler: while lit-ppo's handlers (or any
other) own SIGINT, one that arrives was raised by code (`raise KeyboardInterrupt` in a reward function or an
environment), which `raised_by_code` tells."""

from __future__ import annotations

import os
import signal

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def exit_status(signum: int) -> int:
    """128 + the signal's number: what a shell reports for a process that signal killed."""
    return 128 + int(signum)


class Stopped(SystemExit):
    """The process stopped on a signal outside the rollout steps (`outside_training`); `line` says where."""

    def __init__(self, signum: int, line: str, shown: bool = False):
        super().__init__(exit_status(signum))
        self.signum, self.line, self.shown = int(signum), line, shown  # shown: the handler printed the line itself


# What the process does when no Preemption handles signals: "start-up" until the first `fit` reaches its rollout
# steps, "the final writes" after (the last checkpoint is on disk then).
_phase = "start-up"
# While train.py imports its libraries no code would print the line of a `Stopped` raised out of an import statement:
# the handler writes it itself (on rank 0) until `handle_signals_outside_training` takes over.
_write_line_on: bool | None = None  # None: not during the imports; True/False: during them, on rank 0 / another rank


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
    if _write_line_on is None:
        raise Stopped(signum, line)
    if _write_line_on:
        os.write(2, (line + "\n").encode())  # from a signal handler: no buffered stream that the import may hold
    raise Stopped(signum, line, shown=True)


def handle_signals_during_imports(rank_zero: bool) -> None:
    """`outside_training` from train.py's first lines, before its imports: a signal while they load (seconds) ends the
    process with the start-up line and 128 + the signal's number, not Python's traceback (SIGINT) or a silent death
    (SIGTERM). `rank_zero`: this process prints the line (the launcher's other ranks do not)."""
    global _write_line_on
    _write_line_on = bool(rank_zero)
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, outside_training)


def handle_signals_outside_training() -> None:
    """Install `outside_training` for PREEMPTION_SIGNALS (from the main thread, at the process's start); the line of
    the `Stopped` it raises is the caller's to print (train.py: `console.show_error`)."""
    global _write_line_on
    _write_line_on = None
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, outside_training)


def raised_by_code(error: BaseException) -> bool:
    """Whether `error` is a KeyboardInterrupt that no Ctrl-C sent: SIGINT is handled by other than Python's default
    handler (lit-ppo's, during a run), so the interrupt came from code: a reward function or an environment that raises
    it. Under the default handler (a notebook, a test) it may be a real Ctrl-C, to let through."""
    return isinstance(error, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is not signal.default_int_handler
