"""Rollout workers (rollout.mode=disaggregated): processes with their own vLLM engines, started by the trainer
(rollout.worker_launch=spawn) or by the user's launcher on any node (external:
`python -m lit_ppo.rollout.disaggregated --connect HOST:PORT [--worker N]`, docs/async.md).

Channel (docs/async.md):
- A TCPStore that the trainer hosts carries the small things: each worker's start signal, its ordered commands
  (`cmd/<worker>/<n>`: generate a request, apply a received weight version, stop) and its answers (`result/...`,
  pickled generations). A store and not a multiprocessing queue: it works the same when a worker runs on another
  node (it connects to `host:port`), and every wait on it can be bounded and interleaved with a liveness check.
- A torch.distributed process group of its own (gloo; built from the store, never the default group, which vLLM
  and Lightning use) carries the weights: the trainer broadcasts the actor's tensors (with model.lora: only the
  adapter's, which each worker loads as a new adapter version) in buckets of at most rollout.weight_push_bucket_mib,
  never through the disk. A thread in each worker receives them as soon as they are sent, while its engine
  generates, so a push costs the trainer the transfer only; the worker applies a version when its ordered commands
  reach it. That order is what makes the schedule exact: the trainer queues "apply version v" before the requests
  that version must generate and after those of earlier versions (RolloutDataModule).

No hang, no orphan: every wait of the trainer has a timeout and checks that the workers are alive, failing with one
line naming the side, the worker and its log file (RolloutWorkerError); each worker polls its parent and exits when
the trainer is gone; `close` stops them (and kills what does not stop). External workers are not the trainer's
children: each sends a heartbeat through the store (a counter, one a second), which the trainer's waits watch, and
exits when the store (the trainer) is gone; `close` sends them stop and waits briefly, killing nothing.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Iterable

import torch

from lit_ppo.contract import CountedTensors, Generation, WeightUpdate
from lit_ppo.errors import RolloutWorkerError
from lit_ppo.rollout.engine import tensor_bytes
from lit_ppo.rollout.worker_messages import ApplyWeights, Generate, Stop

POLL_S = 0.01  # how often a wait looks at the store and the workers' liveness
HEARTBEAT_S = 1.0  # how often an external worker adds to its heartbeat counter
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The launcher's rendezvous variables: a worker must not join the trainer's process group with them (vLLM would)."""


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _gloo_group(store, rank: int, size: int, timeout_s: float, host: str):
    """A gloo process group of its own over `store` (not torch.distributed's default group)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = _timedelta(timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("weights/", store), rank, size, options)


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterable[tuple[list[tuple[str, str, list[int]]], torch.Tensor]]:
    """The tensors packed into flat byte buckets of at most `bucket_bytes` (a larger tensor is a bucket of its own):
    (per tensor: name, dtype, shape; the bucket's uint8 bytes). Streamed: one bucket's tensors are held at a time,
    so a gathered FSDP tensor is freed once packed."""
    entries, parts, size = [], [], 0
    for name, tensor in named_tensors:
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if parts and size + nbytes > bucket_bytes:
            yield entries, torch.cat(parts)
            entries, parts, size = [], [], 0
        entries.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)))
        parts.append(tensor.cpu().reshape(-1).view(torch.uint8))
        size += nbytes
    if parts:
        yield entries, torch.cat(parts)


def unpack_bucket(entries: list[tuple[str, str, list[int]]], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one bucket received as bytes (views into `flat`)."""
    tensors, offset = [], 0
    for name, dtype, shape in entries:
        dtype = getattr(torch, dtype)
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        tensors.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
        offset += nbytes
    return tensors


class RolloutWorkers:
    """The trainer's side: starts `workers` worker processes, sends them requests in order, pushes weights (or a LoRA
    adapter), collects results. An engine of the contract (`lit_ppo.contract.RolloutEngine`: `generate`, `update_weights`, `wake_up`, `sleep`, `close`)
    so that evaluation runs through it unchanged; rollouts use `submit` and `collect` to generate ahead."""

    def __init__(
        self,
        *,
        engine_kwargs: dict,
        workers: int,
        devices_per_worker: int,
        trainer_devices: int,
        log_dir: Path,
        start_timeout_s: float,
        batch_timeout_s: float,
        push_timeout_s: float,
        bucket_mib: int,
        max_logprob_abs_diff: float | None = None,
        host: str | None = None,
        launch: str = "spawn",
        port: int = 0,
        heartbeat_timeout_s: float = 60.0,
    ):
        import torch.distributed as dist

        self.workers = workers
        self.external = launch == "external"
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.push_timeout_s = push_timeout_s
        self.bucket_bytes = bucket_mib * 2**20
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.host = host or os.environ.get("LIT_PPO_ROLLOUT_HOST", "127.0.0.1")
        try:  # the server listens on every interface; `host` is the address the workers are told
            self.store = dist.TCPStore(
                self.host, port, is_master=True, wait_for_workers=False, timeout=_timedelta(start_timeout_s)
            )
        except RuntimeError as e:
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise RolloutWorkerError(
                f"trainer: cannot host the rollout workers' store on port {port} ({reason}); fix: set "
                "rollout.worker_port to a free port on this node"
            ) from None
        self.address = f"{self.host}:{self.store.port}"
        spec = {
            "engine": engine_kwargs,
            "push_timeout_s": push_timeout_s,
            "max_logprob_abs_diff": max_logprob_abs_diff,
            "workers": workers,
        }
        self.store.set("spec", pickle.dumps(spec))
        self.nodes: dict[int, tuple[str, int]] = {}  # external: each connected worker's (hostname, pid)
        self.beats = [0] * workers  # external: the last heartbeat count seen of each worker, and when (monotonic)
        self.beats_seen = [time.monotonic()] * workers
        self.commands = [0] * workers  # commands sent to each worker
        self.tickets = 0
        self.pushes = 0
        self.version: int | None = None  # the last version pushed
        self.pushed_adapter_version = 0  # model.lora: the adapter version of the last push
        self.procs: list[subprocess.Popen] = []
        self.exit_codes: list[int | None] = []  # spawned workers' exit codes once close() has stopped them
        self.group = None
        self.failed = False  # a worker failed or did not answer: close() kills instead of waiting for it
        started = time.perf_counter()
        try:
            if self.external:
                self._wait_for_external_workers(start_timeout_s)
            else:
                for i in range(workers):
                    self.procs.append(self._spawn(i, devices_per_worker, trainer_devices))
            for i in range(workers):
                self._wait(f"ready/{i}", start_timeout_s, "its engine's start", "rollout.worker_start_timeout_s", i)
            self.group = _gloo_group(self.store, 0, workers + 1, push_timeout_s, self.host)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - started

    # ------------------------------------------------------------ processes

    def log_file(self, worker: int) -> Path:
        return self.log_dir / f"rollout_worker{worker}.log"

    def _spawn(self, worker: int, devices_per_worker: int, trainer_devices: int) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        # The worker imports this checkout of lit_ppo, whatever is installed.
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
        if torch.cuda.is_available():  # its own devices: the ones after the trainer's
            visible = env.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
            first = trainer_devices + worker * devices_per_worker
            mine = ids[first : first + devices_per_worker]
            if len(mine) < devices_per_worker:
                raise RolloutWorkerError(
                    f"rollout worker {worker} needs devices {first}..{first + devices_per_worker - 1} after the "
                    f"trainer's {trainer_devices}, but {len(ids)} are visible; fix: lower rollout.workers or "
                    "rollout.devices, or make more devices visible"
                )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        log = open(self.log_file(worker), "ab")
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "lit_ppo.rollout.disaggregated", self.host, str(self.store.port), str(worker)]
                + [str(self.workers)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            log.close()

    def _wait_for_external_workers(self, timeout_s: float) -> None:
        """worker_launch=external: wait until every worker has connected and started its engine, or fail naming the
        workers that never connected, the address they must reach and how to start them."""
        deadline = time.monotonic() + timeout_s
        while not all(self.store.check([f"ready/{i}"]) for i in range(self.workers)):
            self._check_alive("its engine's start")
            if time.monotonic() > deadline:
                self.failed = True
                never = [i for i in range(self.workers) if not self.store.check([f"hello/{i}"])]
                slow = [i for i in range(self.workers) if i not in never and not self.store.check([f"ready/{i}"])]
                numbers = ", ".join(map(str, never or slow))
                if never:
                    raise RolloutWorkerError(
                        f"trainer: rollout worker(s) {numbers} of {self.workers} never connected to the trainer at "
                        f"{self.address} within rollout.worker_start_timeout_s={timeout_s:g} s "
                        "(rollout.worker_launch=external: the launcher starts them); fix: run `python -m "
                        f"lit_ppo.rollout.disaggregated --connect {self.address} --worker <N>` for each on a node "
                        f"that reaches {self.address} (docs/async.md), or rollout.worker_launch=spawn"
                    )
                raise RolloutWorkerError(
                    f"trainer: rollout worker(s) {numbers} connected to {self.address} but did not start their engines "
                    f"within rollout.worker_start_timeout_s={timeout_s:g} s; their logs are on their nodes "
                    f"({', '.join(self._where(i) for i in slow)}); fix: raise rollout.worker_start_timeout_s if they are "
                    "only slow"
                )
            time.sleep(POLL_S)

    def _where(self, worker: int) -> str:
        """The worker's pid (external: and node), as the messages name it."""
        if not self.external:
            return f"pid {self.procs[worker].pid}" if worker < len(self.procs) else "not started"
        if worker not in self.nodes and self.store.check([f"hello/{worker}"]):
            self.nodes[worker] = pickle.loads(self.store.get(f"hello/{worker}"))
        if worker not in self.nodes:
            return "not connected"
        node, pid = self.nodes[worker]
        return f"pid {pid} on {node}"

    def _log(self, worker: int) -> str:
        """Where the worker's log is, as the messages name it."""
        if not self.external:
            return f"see {self.log_file(worker)}"
        node = self.nodes[worker][0] if worker in self.nodes else "its node"
        return f"its log is on {node} (its launcher's output)"

    def _check_alive(self, what: str) -> None:
        if self.external:
            self._check_heartbeats(what)
            return
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                last = self._error_line(i)
                self.failed = True
                raise RolloutWorkerError(
                    f"trainer: rollout worker {i} (pid {proc.pid}) exited with code {code} while the trainer waited "
                    f"for {what}{': ' + last if last else ''}; see {self.log_file(i)}"
                )

    def _check_heartbeats(self, what: str) -> None:
        """External workers: a worker that reported an error, or whose heartbeat stopped for
        rollout.worker_heartbeat_timeout_s, stops the run naming it and its node."""
        now = time.monotonic()
        for i in range(self.workers):
            last = self._error_line(i)
            if last:
                self.failed = True
                raise RolloutWorkerError(
                    f"trainer: rollout worker {i} ({self._where(i)}) failed while the trainer waited for {what}: "
                    f"{last}; {self._log(i)}"
                )
            beat = self.store.add(f"heartbeat/{i}", 0)
            if beat != self.beats[i]:
                self.beats[i], self.beats_seen[i] = beat, now
            elif beat > 0 and now - self.beats_seen[i] > self.heartbeat_timeout_s:
                self.failed = True
                raise RolloutWorkerError(
                    f"trainer: rollout worker {i} ({self._where(i)}) sent no heartbeat for "
                    f"rollout.worker_heartbeat_timeout_s={self.heartbeat_timeout_s:g} s while the trainer waited for "
                    f"{what}: it died or its node is unreachable; {self._log(i)}"
                )

    def _error_line(self, worker: int) -> str:
        key = f"error/{worker}"
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def _wait(self, key: str, timeout_s: float, what: str, setting: str, worker: int) -> bytes:
        """The value of `key` once a worker sets it; RolloutWorkerError when a worker dies or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            self._check_alive(what)
            if time.monotonic() > deadline:
                self.failed = True
                raise RolloutWorkerError(
                    f"trainer: rollout worker {worker} ({self._where(worker)}) gave no {what} within "
                    f"{setting}={timeout_s:g} s; {self._log(worker)}; fix: raise {setting} if it is only slow"
                )
            time.sleep(POLL_S)
        value = self.store.get(key)
        self.store.delete_key(key)
        return value

    def _send(self, worker: int, command: Generate | ApplyWeights | Stop) -> None:
        self.store.set(f"cmd/{worker}/{self.commands[worker]}", pickle.dumps(command))
        self.commands[worker] += 1

    # ------------------------------------------------------------ generation

    def submit(self, prompt_token_ids: list[list[int]], **params) -> list[tuple[int, int, int]]:
        """Queue generation of these prompts (contiguous shares over the workers, behind what each has queued);
        returns the tickets to `collect`. `params`: those of `VLLMEngine.generate` (seeds: one per prompt)."""
        tickets = []
        n_prompts = len(prompt_token_ids)
        for worker in range(self.workers):
            start, stop = worker * n_prompts // self.workers, (worker + 1) * n_prompts // self.workers
            share = dict(params)
            if share.get("seeds") is not None:
                share["seeds"] = share["seeds"][start:stop]
            if isinstance(share.get("max_tokens"), list):
                share["max_tokens"] = share["max_tokens"][start:stop]
            self.tickets += 1
            self._send(worker, Generate(self.tickets, {"prompt_token_ids": prompt_token_ids[start:stop], **share}))
            tickets.append((worker, self.tickets, start))
        return tickets

    def collect(self, tickets: list[tuple[int, int, int]]) -> tuple[list[Generation], list[int], float]:
        """The generations of `submit`'s tickets in prompt order, each one's policy version, and the workers' longest
        generation time (s)."""
        generations, versions, seconds = [], [], 0.0
        for worker, ticket, offset in tickets:
            share, version, worker_seconds = pickle.loads(
                self._wait(
                    f"result/{worker}/{ticket}",
                    self.batch_timeout_s,
                    "rollout batch",
                    "rollout.batch_timeout_s",
                    worker,
                )
            )
            for g in share:
                g.prompt_index += offset
            generations += share
            versions += [version] * len(share)
            seconds = max(seconds, worker_seconds)
        return generations, versions, seconds

    def generate(self, prompt_token_ids: list[list[int]], **params) -> list[Generation]:
        """`VLLMEngine.generate` on the workers, behind what they have queued (evaluation)."""
        return self.collect(self.submit(prompt_token_ids, **params))[0]

    # ------------------------------------------------------------ weights

    @property
    def adapter_version(self) -> int:
        """The adapter version of the last push (model.lora); 0 before one, or with full weights."""
        return self.pushed_adapter_version

    @torch.no_grad()
    def update_weights(self, update: WeightUpdate) -> int:
        """Broadcast the update's tensors (with model.lora the adapter alone) to every worker in buckets, then queue
        "apply `update.policy_version`" behind each one's queued requests: those generate with the version they were
        queued after. With the apply goes the update's probe (a sequence and the trainer's log-probs of it at
        temperature 1), which each worker compares with its engine's once it applied the version; a worker whose
        weights differ stops with the reason (reported at the trainer's next wait). An adapter is loaded by each worker
        as adapter `adapter_version` of its engine from memory (`VLLMEngine.sync_adapter`), removing the previous one;
        a worker whose engine then does not serve exactly that adapter (vLLM's list_loras) stops with the reason.
        Every generation records the policy version (and adapter version) that sampled it. Returns the bytes pushed."""
        version, probe = update.policy_version, update.probe() if update.probe is not None else None
        if update.adapter is not None:
            a = update.adapter
            push, moved = self._push(a.tensors.items(), version), tensor_bytes(a.tensors)
            message = ApplyWeights(push, version, probe, a.peft_config, a.adapter_version)
            self.pushed_adapter_version = a.adapter_version
        else:
            counted = CountedTensors(update.tensors)
            push = self._push(counted, version)
            moved = counted.bytes
            message = ApplyWeights(push, version, probe)
        for worker in range(self.workers):
            self._send(worker, message)
        return moved

    def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Broadcast the tensors in buckets to every worker's receiver; returns the push's number."""
        self._check_alive("the weight push")
        push = self.pushes
        for b, (entries, flat) in enumerate(weight_buckets(named_tensors, self.bucket_bytes)):
            self.store.set(f"push/{push}/{b}", pickle.dumps((entries, flat.numel())))
            started = time.monotonic()
            try:
                _broadcast(self.group, flat)
            except RuntimeError as e:
                seconds = time.monotonic() - started
                self._check_alive("the weight push")  # a dead worker is the better message
                if self.external:  # its heartbeat tells within its timeout
                    deadline = time.monotonic() + self.heartbeat_timeout_s + HEARTBEAT_S
                    while time.monotonic() < deadline:
                        self._check_alive("the weight push")
                        time.sleep(POLL_S)
                self.failed = True
                logs = (
                    "their logs are on their nodes"
                    if self.external
                    else "see " + ", ".join(str(self.log_file(i)) for i in range(self.workers))
                )
                raise RolloutWorkerError(
                    f"trainer: the weight push of version {version} (bucket {b}, {flat.numel() / 2**20:.1f} MiB) did "
                    f"not complete within rollout.weight_push_timeout_s={self.push_timeout_s:g} s "
                    f"({seconds:.1f} s, {type(e).__name__}); a rollout worker is stuck: {logs}"
                ) from None
        self.store.set(f"push/{push}/done", b"1")
        self.pushes += 1
        self.version = version
        return push

    def wake_up(self) -> None:  # the workers' engines never sleep: they generate while the trainer trains
        pass

    def sleep(self) -> None:
        pass

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the workers: a stop command behind their queues, then SIGKILL for what has not exited (at once
        after a failure: a stuck worker never reads its queue). External workers, not this process's to kill, get the
        stop command and a brief wait for their acknowledgement; then the store closes, which ends any still running."""
        if self.failed:
            timeout_s = 0.0
        if self.external:
            self._close_external(min(timeout_s, 10.0))
            return
        for worker, proc in enumerate(self.procs):
            if proc.poll() is None:
                try:
                    self._send(worker, Stop())
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
        self.group = None

    def _close_external(self, timeout_s: float) -> None:
        if self.store is None:
            return
        try:
            for worker in range(self.workers):
                if self.store.check([f"hello/{worker}"]):
                    self._send(worker, Stop())
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not all(
                self.store.check([f"stopped/{i}"]) or not self.store.check([f"hello/{i}"]) for i in range(self.workers)
            ):
                time.sleep(POLL_S)
        finally:
            # Dropping the store (the gloo group holds it too) stops its server: a worker still running sees it gone.
            self.group = None
            self.store = None


# ================================================================ the worker process


def _watch_parent(parent: int, stopping: threading.Event) -> None:
    """End this worker when the trainer is gone (SIGKILL leaves no chance to stop it): its parent changes."""
    while not stopping.wait(0.5):
        if os.getppid() != parent:
            os._exit(3)


def send_heartbeats(store, worker: int, stopping: threading.Event) -> None:
    """External workers: count up the worker's heartbeat in the store (the trainer watches it); end the worker when
    the store, hosted by the trainer, is gone."""
    try:
        while not stopping.is_set():
            store.add(f"heartbeat/{worker}", 1)
            stopping.wait(HEARTBEAT_S)
    except BaseException as e:  # noqa: BLE001 - any failure of the store means the trainer is gone
        if stopping.is_set():
            return  # the worker is ending anyway
        print(f"rollout worker {worker}: the trainer's store is gone ({type(e).__name__}); exiting", flush=True)
        os._exit(3)


def stop_threads(stopping: threading.Event, threads: list[threading.Thread]) -> None:
    """Stop and join a worker's threads before it ends. A daemon thread still inside a store or gloo call when the
    interpreter finalizes is ended by pthread_exit through C++ frames that must not unwind: `terminate called without
    an active exception` and SIGABRT, on whichever exit the race is lost (more often on slower machines)."""
    stopping.set()
    for thread in threads:
        thread.join()


def _address_towards(host: str, port: int) -> str:
    """This node's address on the route to `host` (no packet is sent): where the worker's end of the gloo group binds,
    which the trainer must reach."""
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _wait_key(store, key: str) -> bytes:
    while not store.check([key]):
        time.sleep(POLL_S)
    value = store.get(key)
    store.delete_key(key)
    return value


class WeightReceiver(threading.Thread):
    """Receives every weight push as soon as the trainer sends it (while the engine generates); `take(push)` hands
    one push's tensors to the main thread when its "apply" command comes up."""

    def __init__(self, store, group, stopping: threading.Event):
        super().__init__(daemon=True)
        self.store, self.group, self.stopping = store, group, stopping
        self.received: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.ready = threading.Condition()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            push = 0
            while True:
                tensors, bucket = [], 0
                while True:
                    key = f"push/{push}/{bucket}"
                    while not (self.store.check([key]) or self.store.check([f"push/{push}/done"])):
                        if self.stopping.wait(POLL_S):
                            return  # the worker stops: no push is in flight after the trainer's stop command
                    if not self.store.check([key]):
                        break  # the push is complete
                    entries, numel = pickle.loads(self.store.get(key))
                    flat = torch.empty(numel, dtype=torch.uint8)
                    _broadcast(self.group, flat)
                    tensors += unpack_bucket(entries, flat)
                    bucket += 1
                with self.ready:
                    self.received[push] = tensors
                    self.ready.notify_all()
                push += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            with self.ready:
                self.failure = e
                self.ready.notify_all()

    def take(self, push: int) -> list[tuple[str, torch.Tensor]]:
        with self.ready:
            while push not in self.received and self.failure is None:
                self.ready.wait(1.0)
            if push not in self.received:
                raise RuntimeError(f"receiving weight push {push} failed: {self.failure}")
            return self.received.pop(push)


def check_probe(engine, probe, max_logprob_abs_diff: float | None, worker: int, version: int) -> None:
    """The weights this worker just applied are the trainer's of that version: its engine's log-probs of the probe
    sequence equal the trainer's (as rollout.max_logprob_abs_diff bounds them in colocated runs)."""
    if probe is None or max_logprob_abs_diff is None:
        return
    prompt, response, expected = probe
    got = engine.sequence_logprobs(prompt, response)
    diff = sum(abs(a - b) for a, b in zip(got, expected)) / len(expected)
    if not diff <= max_logprob_abs_diff:  # NaN too
        raise RuntimeError(
            f"rollout worker {worker}: after applying policy version {version} its log-probs of a probe sequence "
            f"differ from the trainer's by {diff:.3f} nats per token (more than rollout.max_logprob_abs_diff="
            f"{max_logprob_abs_diff}): the pushed weights did not arrive intact"
        )


def worker_main(
    host: str, port: int, worker: int, workers: int | None, *, external: bool = False, connect_timeout_s: float = 60.0
) -> None:
    """One rollout worker: connect to the trainer's store at host:port, start the engine of its spec, then follow the
    worker's ordered commands. `external`: started by the user's launcher (not the trainer), on any node: it sends a
    heartbeat instead of watching its parent, and leaves the launcher's rendezvous variables (DIST_ENV) out of vLLM's
    way. `workers`: None takes the trainer's rollout.workers."""
    import torch.distributed as dist

    # Every thread this worker starts watches `stopping` and is joined before the worker ends: a thread still inside
    # the store's or gloo's C++ code while the interpreter tears down aborts the process (`terminate called without an
    # active exception`, code -6), which its launcher takes for a crash.
    stopping = threading.Event()
    threads: list[threading.Thread] = []
    if external:
        for key in DIST_ENV:
            os.environ.pop(key, None)
    else:
        threads.append(threading.Thread(target=_watch_parent, args=(os.getppid(), stopping), daemon=True))
        threads[-1].start()
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=_timedelta(connect_timeout_s))
    except RuntimeError as e:
        print(
            f"rollout worker {worker}: could not connect to the trainer at {host}:{port} within {connect_timeout_s:g} s "
            f"({str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__}); fix: start the trainer "
            "(rollout.worker_launch=external) and check that this node reaches that address, or raise "
            "--connect-timeout-s",
            flush=True,
        )
        os._exit(2)
    try:
        spec = pickle.loads(store.get("spec"))
        if not 0 <= worker < spec["workers"] or workers not in (None, spec["workers"]):
            print(
                f"rollout worker {worker}{f' of --workers {workers}' if workers else ''}: the trainer at {host}:{port} "
                f"expects rollout.workers={spec['workers']} (numbers 0..{spec['workers'] - 1}); fix: start that many "
                "workers, numbered from 0",
                flush=True,
            )
            os._exit(2)
        workers = spec["workers"]
        if external:
            if store.add(f"claim/{worker}", 1) != 1:
                raise RuntimeError(
                    f"rollout worker {worker}: another worker connected as number {worker} already; fix: give each "
                    "worker its own --worker (or SLURM_PROCID / RANK)"
                )
            store.set(f"hello/{worker}", pickle.dumps((socket.gethostname(), os.getpid())))
            threads.append(threading.Thread(target=send_heartbeats, args=(store, worker, stopping), daemon=True))
            threads[-1].start()
            print(f"rollout worker {worker} of {workers}: connected to the trainer at {host}:{port}", flush=True)
        from lit_ppo.rollout.engine import VLLMEngine

        started = time.perf_counter()
        engine = VLLMEngine(**spec["engine"])
        print(f"rollout worker {worker}: engine started in {time.perf_counter() - started:.1f} s", flush=True)
        store.set(f"ready/{worker}", b"1")
        own_host = _address_towards(host, port) if external else host
        group = _gloo_group(store, worker + 1, workers + 1, spec["push_timeout_s"], own_host)
        receiver = WeightReceiver(store, group, stopping)
        receiver.start()
        threads.append(receiver)
        version = 0  # the engine starts from model_dir: the initial policy
        n = 0
        while True:
            command = pickle.loads(_wait_key(store, f"cmd/{worker}/{n}"))
            n += 1
            if isinstance(command, Stop):
                break
            if isinstance(command, ApplyWeights):
                version = command.policy_version
                if command.peft_config is None:
                    engine.sync_weights(receiver.take(command.push))
                else:  # model.lora: the adapter alone, loaded from memory as a new adapter version
                    # It stops the worker unless its engine then serves exactly this adapter (vLLM's list_loras).
                    engine.sync_adapter(dict(receiver.take(command.push)), command.peft_config, command.adapter_version)
                print(f"rollout worker {worker}: policy version {version} applied", flush=True)
                check_probe(engine, command.probe, spec["max_logprob_abs_diff"], worker, version)
            elif isinstance(command, Generate):
                started = time.perf_counter()
                generations = engine.generate(**command.request)
                seconds = time.perf_counter() - started
                store.set(f"result/{worker}/{command.ticket}", pickle.dumps((generations, version, seconds)))
        engine.close()
        stop_threads(stopping, threads)
        # The gloo group's pairs are closed here, while the trainer (which waits for "stopped") still holds its end.
        receiver.group = group = None
        store.set(f"stopped/{worker}", b"1")
    except BaseException as e:
        traceback.print_exc()
        sys.stdout.flush()
        last = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        try:
            store.set(f"error/{worker}", last.encode())
        finally:
            os._exit(1)


def main(argv: list[str]) -> None:
    """The trainer's spawned form `HOST PORT WORKER WORKERS`, or a launcher's
    `--connect HOST:PORT [--worker N] [--workers N]` (rollout.worker_launch=external)."""
    if argv and not argv[0].startswith("-"):
        host, port, worker, workers = argv
        worker_main(host, int(port), int(worker), int(workers))
        return
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m lit_ppo.rollout.disaggregated",
        description="A rollout worker started by a launcher (rollout.worker_launch=external, docs/async.md).",
    )
    parser.add_argument(
        "--connect", required=True, metavar="HOST:PORT", help="the trainer's store (the plan prints it)"
    )
    parser.add_argument("--worker", type=int, help="this worker's number, 0..workers-1; default: SLURM_PROCID or RANK")
    parser.add_argument(
        "--workers", type=int, help="checked against the trainer's rollout.workers; default: the trainer's"
    )
    parser.add_argument(
        "--connect-timeout-s", type=float, default=900.0, help="seconds to retry connecting while the trainer starts"
    )
    args = parser.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--connect {args.connect}: expected HOST:PORT, e.g. --connect node0:29600")
    worker = args.worker
    if worker is None:
        index = os.environ.get("SLURM_PROCID") or os.environ.get("RANK")
        if index is None or not index.isdigit():
            parser.error("no worker number: give --worker N, or run it under srun (SLURM_PROCID) or torchrun (RANK)")
        worker = int(index)
    worker_main(host, int(port), worker, args.workers, external=True, connect_timeout_s=args.connect_timeout_s)


if __name__ == "__main__":
    # Ctrl-C, and the SIGTERM/SIGUSR1 a scheduler sends to every process of a job, are the trainer's to handle: it
    # checkpoints (which needs the workers' batches in flight) and then stops its workers; they end with it anyway.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    main(sys.argv[1:])
