"""Bounded reward calls: worker processes that score one sample each under `reward.timeout_s` (`RewardWorkers`),
and, for the default `reward.workers=0`, the in-process time limit `waits.call_with_deadline`."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import signal
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from lit_ppo.console import capture_prints
from lit_ppo.errors import ConfigError, RewardError
from lit_ppo.rewards.calling import RewardCall, _name

log = logging.getLogger("lit_ppo")


class _Timeout(Exception):
    pass


def _worker_main(conn, call: RewardCall) -> None:
    """A worker process: score one sample at a time in its main thread (where math-verify's SIGALRM
    timeouts work), answer (index, "ok", (scores, metrics)) or (index, "error", (type, message, timed out))."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops the workers
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        index, sample = task
        try:
            with capture_prints(lambda line: conn.send(("printed", line))):  # the trainer shows them, and keeps them
                scores, metrics = call(*([x] for x in sample))
            reply = (index, "ok", (list(scores), dict(metrics)))
            conn.send(reply)
        except BaseException as e:  # math-verify's TimeoutException is a BaseException
            timed_out = isinstance(e, TimeoutError) or "timeout" in type(e).__name__.lower()
            conn.send((index, "error", (type(e).__name__, str(e)[:2000], timed_out)))


class _Worker:
    def __init__(self, context, call: RewardCall):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, call), daemon=True, name="lit-ppo-reward")
        self.process.start()
        child.close()
        self.ready = False
        self.task: tuple[int, float] | None = None  # (sample index, start time)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()


class RewardWorkers:
    """`workers` processes that score one sample each at a time, each under `timeout_s` seconds.

    A sample whose worker does not answer in time is killed with its worker; a worker that dies
    (os._exit, a segfault, the OOM killer) takes only its sample. Either way a fresh worker replaces
    it. After `give_up_after` timeouts in a row (no result between them: with N workers, the first N samples of a
    function that hangs on everything, a remote judge that is down), the call's other samples, waiting or in flight,
    are not scored ("given up"; their workers are killed and replaced at the next call): a call then costs about
    `ceil(give_up_after / workers)` timeouts, not one per `workers` samples. Workers start with `spawn`: forking a
    process that holds vLLM's and torch's threads is unsafe."""

    START_TIMEOUT_S = 300.0  # importing the reward's module (torch, sympy) on a busy machine

    def __init__(
        self,
        call: RewardCall,
        workers: int,
        timeout_s: float | None,
        give_up_after: int,
        printed: Callable[[str], None] | None = None,
    ):
        try:
            pickle.dumps(call)
        except Exception as e:
            raise ConfigError(
                f"reward.workers={workers} needs a reward function that can be sent to another process "
                f"({_name(call.fn)}: {e}); fix: use a module-level function or class, or reward.workers=0"
            ) from e
        self.call, self.size, self.timeout_s, self.give_up_after = call, workers, timeout_s, give_up_after
        self.printed = printed or print  # a line the function printed in a worker (`console.printed_by`)
        self.scored = 0  # samples of the call in progress with an outcome
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.restarts = 0

    def _start_workers(self) -> None:
        self.workers = [w for w in self.workers if w.process.is_alive()]
        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.context, self.call))

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self.workers.remove(worker)
        self.workers.append(_Worker(self.context, self.call))
        self.restarts += 1

    def run(self, samples: list[tuple]) -> list[tuple[str, Any]]:
        """One outcome per sample: ("ok", (scores, metrics)), ("error", (type, message, timed out)),
        ("timeout", message), ("died", message) or ("given up", message)."""
        self._start_workers()
        outcomes: list = [None] * len(samples)
        pending = deque(range(len(samples)))
        self.scored = 0
        started = time.monotonic()
        timeouts_in_a_row = 0
        while pending or any(w.task for w in self.workers):
            if timeouts_in_a_row >= self.give_up_after:  # hung on everything: the rest would hang too
                message = f"not scored: {timeouts_in_a_row} samples in a row ran past reward.timeout_s before it"
                for worker in [w for w in self.workers if w.task]:
                    outcomes[worker.task[0]] = ("given up", message)
                    worker.stop()
                    self.workers.remove(worker)
                for index in pending:
                    outcomes[index] = ("given up", message)
                break
            now = time.monotonic()
            for worker in self.workers:
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    worker.conn.send((index, samples[index]))
                    worker.task = (index, now)
            deadlines = [w.task[1] + self.timeout_s for w in self.workers if w.task and self.timeout_s]
            deadlines += [started + self.START_TIMEOUT_S for w in self.workers if not w.ready]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            wait([w.conn for w in self.workers] + [w.process.sentinel for w in self.workers], timeout)
            now = time.monotonic()
            for worker in list(self.workers):
                message = None
                if worker.conn.poll():
                    try:
                        message = worker.conn.recv()
                    except (EOFError, OSError):
                        message = None
                if message is not None:
                    if message[0] == "ready":
                        worker.ready = True
                        continue
                    if message[0] == "printed":
                        self.printed(message[1])
                        continue
                    index, status, payload = message
                    outcomes[index] = (status, payload)
                    self.scored += 1
                    worker.task = None
                    timeouts_in_a_row = 0  # it answered (the function's own timeouts included): not hung
                elif not worker.process.is_alive():
                    code = worker.process.exitcode
                    if worker.task is None:  # died while starting: the function cannot be loaded there
                        worker.stop()
                        raise RewardError(
                            f"a reward worker process exited with code {code} before scoring anything "
                            f"({_name(self.call.fn)}); fix: make its module importable, or set reward.workers=0"
                        )
                    outcomes[worker.task[0]] = ("died", f"killed its worker process (exit code {code})")
                    self.scored += 1
                    timeouts_in_a_row = 0
                    self._replace(worker)
                elif worker.task and self.timeout_s and now - worker.task[1] > self.timeout_s:
                    outcomes[worker.task[0]] = ("timeout", f"no result after reward.timeout_s={self.timeout_s:g}s")
                    self.scored += 1
                    timeouts_in_a_row += 1
                    self._replace(worker)
                elif not worker.ready and now - started > self.START_TIMEOUT_S:
                    raise RewardError(
                        f"reward workers did not start in {self.START_TIMEOUT_S:.0f}s; fix: set reward.workers=0"
                    )
        return outcomes

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.conn.send(None)
            worker.stop()
        self.workers = []
