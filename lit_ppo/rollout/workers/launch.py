"""How the rollout workers start and how the trainer watches them: one strategy object per rollout.workers.launch.

- `SpawnedLaunch` (spawn): the trainer starts its workers as child processes on its own node, each on the devices after
  the trainer's and logging to `<run>/logs/rollout_worker<N>.log`; a worker's death is seen at once (its exit code);
  each worker polls its parent and exits when the trainer is gone; stopping them ends with SIGKILL for what does not
  stop.
- `ExternalLaunch` (external): the user's launcher starts them on any node (`python -m lit_ppo.rollout.workers
  --connect HOST:PORT`, docs/async.md); they are not the trainer's children: each sends a heartbeat through the store
  (a counter, one a second), which the trainer's waits watch, and exits when the store (the trainer) is gone; stopping
  them sends stop and waits briefly, killing nothing.

Both name a failing worker with its pid (external: and node) and where its log is, in one line (RolloutWorkerError).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from lit_ppo.errors import RolloutWorkerError
from lit_ppo.rollout.weight_transfer.transport import POLL_S
from lit_ppo.rollout.workers.messages import Hello, Stop
from lit_ppo.topology import LAUNCHER_VARIABLES

HEARTBEAT_S = 1.0  # how often an external worker adds to its heartbeat counter

Send = Callable[[int, Stop], None]


SPAWNED_EXIT_SETTLE_S = 2.0
"""The longest a spawned worker's exit takes to show to `poll` after its sockets closed: the kernel closes a killed
process's files first, and it becomes a child that `poll` reaps a moment later (under load, later still)."""


def error_line(store, worker: int) -> str:
    """The one line a worker reported when it failed (`error/<worker>`), or ""."""
    key = f"error/{worker}"
    return store.get(key).decode() if store.check([key]) else ""


def worker_devices(env: dict, worker: int, devices_per_worker: int, trainer_devices: int) -> str | None:
    """On GPUs, a spawned worker's own devices (CUDA_VISIBLE_DEVICES): the ones after the trainer's, or with
    devices_per_worker=0 the trainer's first (shared); None on CPU."""
    if not torch.cuda.is_available():
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return worker_device_ids(ids, worker, devices_per_worker, trainer_devices)


def worker_device_ids(ids: list[str], worker: int, devices_per_worker: int, trainer_devices: int) -> str:
    """Worker `worker`'s devices among the visible `ids` (the trainer's are the first `trainer_devices`)."""
    if devices_per_worker == 0:  # shares the trainer's first device (one GPU: trainer and worker on it)
        return ids[0]
    first = trainer_devices + worker * devices_per_worker
    mine = ids[first : first + devices_per_worker]
    if len(mine) < devices_per_worker:
        raise RolloutWorkerError(
            f"rollout worker {worker} needs devices {first}..{first + devices_per_worker - 1} after the trainer's "
            f"{trainer_devices}, but {len(ids)} are visible; fix: lower rollout.workers.count or "
            "rollout.workers.devices, or make more devices visible"
        )
    return ",".join(mine)


class SpawnedLaunch:
    """rollout.workers.launch=spawn: the workers are this process's children (see the module's docstring)."""

    def __init__(self, *, store, host: str, workers: int, log_dir: Path, devices_per_worker: int, trainer_devices: int):
        self.store, self.host, self.workers, self.log_dir = store, host, workers, log_dir
        self.devices_per_worker, self.trainer_devices = devices_per_worker, trainer_devices
        self.procs: list[subprocess.Popen] = []
        self.exit_codes: list[int | None] = []  # the workers' exit codes once `stop` has ended them
        self.failed = False  # a worker failed or did not answer: stopping kills instead of waiting for it

    def start(self, timeout_s: float) -> None:
        """Start every worker (the trainer then waits for their engines)."""
        for worker in range(self.workers):
            self.procs.append(self._spawn(worker))

    def log_file(self, worker: int) -> Path:
        return self.log_dir / f"rollout_worker{worker}.log"

    def _spawn(self, worker: int) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
        # The worker imports this checkout of lit_ppo, whatever is installed.
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH", "")])
        devices = worker_devices(env, worker, self.devices_per_worker, self.trainer_devices)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        log = open(self.log_file(worker), "ab")
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "lit_ppo.rollout.workers", self.host, str(self.store.port), str(worker)]
                + [str(self.workers)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            log.close()

    def where(self, worker: int) -> str:
        """The worker's pid, as the messages name it."""
        return f"pid {self.procs[worker].pid}" if worker < len(self.procs) else "not started"

    def log(self, worker: int) -> str:
        """Where the worker's log is, as the messages name it."""
        return f"see {self.log_file(worker)}"

    def logs(self) -> str:
        return "see " + ", ".join(str(self.log_file(i)) for i in range(self.workers))

    def settle_s(self) -> float:
        """How long a failed transfer waits for a dead worker to show: a killed child's sockets close (the transfer
        fails) moments before `poll` sees its exit, so a push that fails at once would otherwise call a worker killed
        during it stuck (issue 36 item 6's worker kills at k = 1)."""
        return SPAWNED_EXIT_SETTLE_S

    def check_alive(self, what: str) -> None:
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                last = error_line(self.store, i)
                self.failed = True
                raise RolloutWorkerError(
                    f"trainer: rollout worker {i} (pid {proc.pid}) exited with code {code} while the trainer waited "
                    f"for {what}{': ' + last if last else ''}; see {self.log_file(i)}"
                )

    def stop(self, send: Send, timeout_s: float) -> None:
        """A stop command behind each worker's queue, then SIGKILL for what has not exited within `timeout_s`."""
        for worker, proc in enumerate(self.procs):
            if proc.poll() is None:
                try:
                    send(worker, Stop())
                except Exception:
                    pass
        deadline = time.monotonic() + timeout_s
        self.exit_codes = []
        for worker, proc in enumerate(self.procs):
            try:
                self.exit_codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                self.exit_codes.append(None)
            if not self.failed and self.exit_codes[-1] != 0:  # a clean stop ends every worker with 0
                logging.getLogger("lit_ppo").warning(
                    f"trainer: rollout worker {worker} (pid {proc.pid}) "
                    + ("did not stop" if self.exit_codes[-1] is None else f"exited with code {self.exit_codes[-1]}")
                    + f" after its stop command; see {self.log_file(worker)}"
                )
        self.procs = []


class ExternalLaunch:
    """rollout.workers.launch=external: the user's launcher starts the workers, which connect to `address`; their
    heartbeats tell the trainer they live (see the module's docstring)."""

    def __init__(self, *, store, address: str, workers: int, heartbeat_timeout_s: float):
        self.store, self.address, self.workers, self.heartbeat_timeout_s = store, address, workers, heartbeat_timeout_s
        self.nodes: dict[int, Hello] = {}  # each connected worker's node and pid
        self.beats = [0] * workers  # the last heartbeat count seen of each worker, and when (monotonic)
        self.beats_seen = [time.monotonic()] * workers
        self.procs: list[subprocess.Popen] = []  # none: the workers are their launcher's processes
        self.exit_codes: list[int | None] = []
        self.failed = False  # a worker failed or did not answer: stopping does not wait for it

    def start(self, timeout_s: float) -> None:
        """Wait until every worker has connected and started its engine, or fail naming the workers that never
        connected, the address they must reach and how to start them."""
        deadline = time.monotonic() + timeout_s
        while not all(self.store.check([f"ready/{i}"]) for i in range(self.workers)):
            self.check_alive("its engine's start")
            if time.monotonic() > deadline:
                self.failed = True
                never = [i for i in range(self.workers) if not self.store.check([f"hello/{i}"])]
                slow = [i for i in range(self.workers) if i not in never and not self.store.check([f"ready/{i}"])]
                numbers = ", ".join(map(str, never or slow))
                if never:
                    raise RolloutWorkerError(
                        f"trainer: rollout worker(s) {numbers} of {self.workers} never connected to the trainer at "
                        f"{self.address} within rollout.workers.start_timeout_s={timeout_s:g} s "
                        "(rollout.workers.launch=external: the launcher starts them); fix: run `python -m "
                        f"lit_ppo.rollout.workers --connect {self.address} --worker <N>` for each on a node "
                        f"that reaches {self.address} (docs/async.md), or rollout.workers.launch=spawn"
                    )
                raise RolloutWorkerError(
                    f"trainer: rollout worker(s) {numbers} connected to {self.address} but did not start their engines "
                    f"within rollout.workers.start_timeout_s={timeout_s:g} s; their logs are on their nodes "
                    f"({', '.join(self.where(i) for i in slow)}); fix: raise rollout.workers.start_timeout_s if they "
                    "are only slow"
                )
            time.sleep(POLL_S)

    def where(self, worker: int) -> str:
        """The worker's pid and node, as the messages name it."""
        if worker not in self.nodes and self.store.check([f"hello/{worker}"]):
            self.nodes[worker] = pickle.loads(self.store.get(f"hello/{worker}"))
        if worker not in self.nodes:
            return "not connected"
        return f"pid {self.nodes[worker].pid} on {self.nodes[worker].hostname}"

    def log(self, worker: int) -> str:
        node = self.nodes[worker].hostname if worker in self.nodes else "its node"
        return f"its log is on {node} (its launcher's output)"

    def logs(self) -> str:
        return "their logs are on their nodes"

    def settle_s(self) -> float:
        """How long a failed transfer waits for a dead worker to show: its heartbeat tells within its timeout."""
        return self.heartbeat_timeout_s + HEARTBEAT_S

    def check_alive(self, what: str) -> None:
        """A worker that reported an error, or whose heartbeat stopped for rollout.workers.heartbeat_timeout_s, stops
        the run naming it and its node."""
        now = time.monotonic()
        for i in range(self.workers):
            last = error_line(self.store, i)
            if last:
                self.failed = True
                raise RolloutWorkerError(
                    f"trainer: rollout worker {i} ({self.where(i)}) failed while the trainer waited for {what}: "
                    f"{last}; {self.log(i)}"
                )
            beat = self.store.add(f"heartbeat/{i}", 0)
            if beat != self.beats[i]:
                self.beats[i], self.beats_seen[i] = beat, now
            elif beat > 0 and now - self.beats_seen[i] > self.heartbeat_timeout_s:
                self.failed = True
                raise RolloutWorkerError(
                    f"trainer: rollout worker {i} ({self.where(i)}) sent no heartbeat for "
                    f"rollout.workers.heartbeat_timeout_s={self.heartbeat_timeout_s:g} s while the trainer waited for "
                    f"{what}: it died or its node is unreachable; {self.log(i)}"
                )

    def stop(self, send: Send, timeout_s: float) -> None:
        """Stop to every connected worker and a brief wait (at most 10 s) for their acknowledgements; the store's
        closing (the caller drops it next) ends any still running."""
        timeout_s = min(timeout_s, 10.0)
        for worker in range(self.workers):
            if self.store.check([f"hello/{worker}"]):
                send(worker, Stop())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(
            self.store.check([f"stopped/{i}"]) or not self.store.check([f"hello/{i}"]) for i in range(self.workers)
        ):
            time.sleep(POLL_S)


Launch = SpawnedLaunch | ExternalLaunch
