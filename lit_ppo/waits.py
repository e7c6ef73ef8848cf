"""Bounded waits: every wait on something outside this rank's own computation has a limit, and when it runs out the
run stops in one line naming what it waited for and the setting to raise.

- Collectives (all-reduces, the weight sync's gathers under FSDP, a checkpoint's barrier, the process group's start):
  the torch.distributed process group's timeout, `trainer.collective_timeout_s`, given to the Lightning strategy
  (`strategy_timeout`). A rank then fails in the collective it waits in (gloo raises; NCCL's watchdog aborts the
  communicator). Which collective that was is not in the backend's message, so the run marks its phases as it enters
  them (`entering`) and `named_timeout` turns the backend's timeout into the one line naming the phase.
- The vLLM engine's start: `rollout.engine_start_timeout_s`, a deadline in this process (`start_within`), since the
  start also waits on the engine's own process and its compilation, not only on collectives.
- Rewards and environment calls have their own limits (`reward.timeout_s`, `rollout.episodes.environment_timeout_s`).
  A reward call that takes more than a few seconds is said on the console while it lasts (`said_while_waiting`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from lit_ppo.errors import UserError, WaitTimeoutError

log = logging.getLogger("lit_ppo")

COLLECTIVE_SETTING = "trainer.collective_timeout_s"
ENGINE_START_SETTING = "rollout.engine_start_timeout_s"

_phase = "the ranks' start (the process group's rendezvous)"  # what this rank is doing now, for the message
_collective_timeout_s: float | None = None  # set by `strategy_timeout`, for the message

# gloo: "Timed out waiting 5000ms for recv operation"; NCCL: "Watchdog caught collective operation timeout";
# the store at the process group's start: "Timed out after 31 seconds waiting for clients".
_BACKEND_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def entering(phase: str) -> None:
    """Mark the phase this rank enters (`the weight sync after rollout step 3`): a collective that times out from now
    on is reported as a wait in it."""
    global _phase
    _phase = phase


def strategy_timeout(strategy_class: type, collective_timeout_s: float) -> dict:
    """The keyword that gives a Lightning strategy its process group's timeout (DDPStrategy and ModelParallelStrategy
    take `timeout`), or none for a strategy without one (a single device has no collectives)."""
    global _collective_timeout_s
    if "timeout" not in inspect.signature(strategy_class).parameters:
        return {}
    _collective_timeout_s = collective_timeout_s
    return {"timeout": timedelta(seconds=collective_timeout_s)}


def collective_timeout() -> timedelta | None:
    """`trainer.collective_timeout_s` for the process groups built after the strategy's (torch's `new_group` would
    take its backend's default otherwise: 10 minutes under NCCL); None where the strategy has no timeout."""
    return None if _collective_timeout_s is None else timedelta(seconds=_collective_timeout_s)


def named_timeout(error: BaseException, rank: int) -> WaitTimeoutError | None:
    """The one-line error for a collective's timeout (None for any other error): what this rank waited for, where
    to look for the rank that did not come, and the setting to raise."""
    # gloo raises a plain RuntimeError, the store a DistStoreError (one); lit-ppo's own errors (an environment's
    # timeout, reward.on_error=raise) say what they are already.
    if _collective_timeout_s is None or isinstance(error, UserError) or not isinstance(error, RuntimeError):
        return None
    if not _BACKEND_TIMEOUT.search(str(error)):
        return None
    return WaitTimeoutError(
        f"rank {rank} waited more than {COLLECTIVE_SETTING}={_collective_timeout_s:g}s for the other ranks in "
        f"{_phase}; a rank hung or stopped there (its log: <run>/logs/run.rank<N>.log); fix: find what held it up, "
        f"or raise {COLLECTIVE_SETTING} if {_phase} is only slow on some ranks"
    )


def start_within(start, timeout_s: float | None, what: str = "the vLLM engine's start"):
    """`start()`, stopped after `timeout_s` seconds (None: no limit) with the one line naming the wait. The deadline
    interrupts Python code and waits on the engine's process at once, and a single long call into C when it returns
    (`call_with_deadline`)."""
    entering(what)
    started = time.monotonic()
    try:
        return call_with_deadline(start, timeout_s, ENGINE_START_SETTING)
    except TimeoutError:
        if timeout_s is None or time.monotonic() - started < timeout_s:
            raise  # the engine's own timeout, not this deadline
        raise WaitTimeoutError(
            f"{what} took more than {ENGINE_START_SETTING}={timeout_s:g}s and was stopped (a model still "
            "downloading, a device busy with another process, a compilation that does not end); fix: see "
            f"<run>/logs/run.log for where it stood, or raise {ENGINE_START_SETTING} (null: no limit)"
        ) from None


class _DeadlinePassed(BaseException):
    """Raised inside a call (a reward's, the engine's start) that ran past its limit; a BaseException, so that the reward's own
    `except Exception` does not take it for a failure it could score."""


DEADLINE_SIGNAL = signal.SIGUSR2  # not SIGALRM: math-verify times its parsing with SIGALRM in the same thread


def call_with_deadline(fn, timeout_s: float | None, setting: str = "reward.timeout_s"):
    """fn() in this (the main) thread, cut after `timeout_s` seconds: a timer thread then signals the main thread,
    whose handler raises inside the call. That stops Python code, sleeps and waits on I/O at once, and a single
    long call into C code (a regex, a solver) when it returns; a call that kills the process is not survived
    (reward.workers > 0 is for those). Raises TimeoutError naming `setting` when cut. Without a limit, or off the main thread
    (where no signal handler runs), fn() is called as it is."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        return fn()
    lock, state = threading.Lock(), {"armed": True, "fired": False}

    def on_signal(signum, frame) -> None:
        if state["armed"] and state["fired"]:
            state["armed"] = False  # once
            raise _DeadlinePassed()

    def fire() -> None:
        with lock:
            if state["armed"]:
                state["fired"] = True
                signal.pthread_kill(threading.main_thread().ident, DEADLINE_SIGNAL)

    previous = signal.signal(DEADLINE_SIGNAL, on_signal)
    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    try:
        try:
            timer.start()
            return fn()
        finally:
            timer.cancel()
            with lock:  # no signal is sent after this; one already sent finds the handler disarmed
                state["armed"] = False
            signal.signal(DEADLINE_SIGNAL, previous)
    except _DeadlinePassed:  # also when it lands while leaving the call
        raise TimeoutError(f"no result after {setting}={timeout_s:g}s") from None


NOTICE_AFTER_S = 5.0  # a wait on user code this long is said on the console (`said_while_waiting`)
NOTICE_EVERY_AT_MOST_S = 300.0


@contextlib.contextmanager
def said_while_waiting(describe: Callable[[float], str], after_s: float | None = None):
    """The block waits on code outside lit-ppo (a reward function): once it has lasted `after_s` seconds (default
    NOTICE_AFTER_S), a console line `describe(seconds so far)` says what it waits for, from a timer thread; again each
    time the wait has doubled (10, 20, 40 s, ...; at least every NOTICE_EVERY_AT_MOST_S). A stall is not silent, and a
    long one does not fill the console."""
    after_s = NOTICE_AFTER_S if after_s is None else after_s
    done, started = threading.Event(), time.monotonic()

    def announce() -> None:
        at = after_s
        while not done.wait(max(0.0, started + at - time.monotonic())):
            log.info(describe(time.monotonic() - started))
            at = min(2 * at, at + NOTICE_EVERY_AT_MOST_S)

    thread = threading.Thread(target=announce, daemon=True, name="lit-ppo-wait-notice")
    thread.start()
    try:
        yield
    finally:
        done.set()
