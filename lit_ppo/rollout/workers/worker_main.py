"""A rollout worker process: connects to the trainer's store, starts the engine of its spec (the engine registry's
row for rollout.engine) and, with multi-turn episodes, builds their environments from the run's settings, then follows its
ordered commands (generate responses or episodes, apply a received weight version, stop) until told to stop or the
trainer is gone.

Started by the trainer (rollout.workers.launch=spawn: `python -m lit_ppo.rollout.workers HOST PORT WORKER WORKERS`) or
by the user's launcher on any node (external: `python -m lit_ppo.rollout.workers --connect HOST:PORT [--worker N]`,
docs/async.md)."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import threading
import time
import traceback

from lit_ppo.errors import first_line
from lit_ppo.rollout.episodes import EpisodeRequest
from lit_ppo.rollout.weight_transfer.transport import probe_mismatch, seconds_delta, take_key
from lit_ppo.rollout.workers.launch import HEARTBEAT_S
from lit_ppo.rollout.workers.messages import ApplyWeights, Generate, Hello, InitWeightTransfer, Result, Stop, WorkerSpec
from lit_ppo.topology import LAUNCHER_VARIABLES, launched_worker_index


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


class WarningLines(logging.Handler):
    """The warnings lit_ppo logs in this worker while it generates (`with` it), which go back to the trainer with the
    result (`take`): e.g. the episode loop's count of episodes scored 0 after environment errors or timeouts."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        print(f"warning: {record.getMessage()}", flush=True)  # and in this worker's log

    def __enter__(self):
        logging.getLogger("lit_ppo").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("lit_ppo").removeHandler(self)

    def take(self) -> tuple[str, ...]:
        lines, self.lines = tuple(self.lines), []
        return lines


def check_probe(engine, probe, max_logprob_abs_diff: float | None, worker: int, version: int) -> None:
    """The weights this worker just applied are the trainer's of that version: its engine's log-probs of the probe
    sequence equal the trainer's (as rollout.max_logprob_abs_diff bounds them in colocated runs)."""
    where = f"rollout worker {worker}: after applying policy version {version}"
    mismatch = probe_mismatch(probe, max_logprob_abs_diff, engine.sequence_logprobs, where)
    if mismatch is not None:
        raise RuntimeError(mismatch)


def _connect(host: str, port: int, worker: int, connect_timeout_s: float):
    """The trainer's store at host:port; a worker that cannot reach it within `connect_timeout_s` says so and exits."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=False, timeout=seconds_delta(connect_timeout_s))
    except RuntimeError as e:
        print(
            f"rollout worker {worker}: could not connect to the trainer at {host}:{port} within {connect_timeout_s:g} s "
            f"({first_line(e, type(e).__name__)[:200]}); fix: start the trainer "
            "(rollout.workers.launch=external) and check that this node reaches that address, or raise "
            "--connect-timeout-s",
            flush=True,
        )
        os._exit(2)


def _join(store, spec: WorkerSpec, worker: int, workers: int | None, where: str, external: bool, heartbeat) -> None:
    """This worker's number checked against the trainer's rollout.workers.count (a wrong one says so and exits); an
    external worker claims its number, says hello and starts its heartbeat (`heartbeat`: the thread's start)."""
    if not 0 <= worker < spec.workers or workers not in (None, spec.workers):
        print(
            f"rollout worker {worker}{f' of --workers {workers}' if workers else ''}: the trainer at {where} "
            f"expects rollout.workers.count={spec.workers} (numbers 0..{spec.workers - 1}); fix: start that many "
            "workers, numbered from 0",
            flush=True,
        )
        os._exit(2)
    if external:
        if store.add(f"claim/{worker}", 1) != 1:
            raise RuntimeError(
                f"rollout worker {worker}: another worker connected as number {worker} already; fix: give each "
                "worker its own --worker (or SLURM_PROCID / RANK)"
            )
        store.set(f"hello/{worker}", pickle.dumps(Hello(socket.gethostname(), os.getpid())))
        heartbeat()
        print(f"rollout worker {worker} of {spec.workers}: connected to the trainer at {where}", flush=True)


def _apply_weights(engine, command: ApplyWeights, spec: WorkerSpec, worker: int) -> None:
    """A received policy version applied by the engine, its version and its probe's log-probs checked."""
    version = command.policy_version
    if command.peft_config is None:  # through vLLM's weight-transfer interface (or HF's copy of it)
        engine.apply_weight_transfer(list(command.updates), version)
    else:  # model.lora: the adapter alone, loaded from memory as a new adapter version
        # It stops the worker unless its engine then serves exactly this adapter (vLLM's list_loras).
        engine.apply_adapter_transfer(list(command.updates), command.peft_config, command.adapter_version)
        engine.set_weight_version(version)
    if engine.weight_version != version:
        raise RuntimeError(
            f"rollout worker {worker}: its engine reports weight version {engine.weight_version} after "
            f"applying policy version {version} (vLLM did not commit it); fix: install the vLLM version "
            "lit-ppo pins (pyproject.toml's extras) and report it with this worker's log if it persists"
        )
    print(f"rollout worker {worker}: policy version {version} applied", flush=True)
    check_probe(engine, command.probe, spec.max_logprob_abs_diff, worker, version)


def _follow_commands(store, spec: WorkerSpec, worker: int, engine, episodes, own_host: str) -> None:
    """The worker's ordered commands until Stop: join the weight-transfer group, apply a version, generate (responses,
    or multi-turn episodes with `episodes`, an EpisodeRunner) and set the result with the warnings logged meanwhile."""
    warnings = WarningLines()
    n = 0
    while True:
        command = pickle.loads(take_key(store, f"cmd/{worker}/{n}"))
        n += 1
        if isinstance(command, Stop):
            return
        if isinstance(command, InitWeightTransfer):  # the first: join the trainer's weight-transfer group
            first = 1 + worker * spec.processes_per_engine  # the trainer is rank 0 of the group
            engine.open_weight_transfer({**command.init_info, "rank_offset": first, "own_host": own_host})
            print(f"rollout worker {worker}: receives weights through {engine.weight_transfer_name}", flush=True)
        elif isinstance(command, ApplyWeights):
            _apply_weights(engine, command, spec, worker)
        elif isinstance(command, Generate):
            started = time.perf_counter()
            with warnings:
                if isinstance(command.request, EpisodeRequest):  # multi-turn episodes
                    generations = episodes.run(engine, command.request)
                else:
                    generations = engine.generate(command.request)
            seconds = time.perf_counter() - started
            result = Result(generations, engine.weight_version, seconds, warnings.take())
            store.set(f"result/{worker}/{command.ticket}", pickle.dumps(result))


def worker_main(
    host: str, port: int, worker: int, workers: int | None, *, external: bool = False, connect_timeout_s: float = 60.0
) -> None:
    """One rollout worker: connect to the trainer's store at host:port, start the engine of its spec, then follow the
    worker's ordered commands. `external`: started by the user's launcher (not the trainer), on any node: it sends a
    heartbeat instead of watching its parent, and leaves the launcher's rendezvous variables (LAUNCHER_VARIABLES) out
    of vLLM's way. `workers`: None takes the trainer's rollout.workers."""
    # Every thread this worker starts watches `stopping` and is joined before the worker ends: a thread still inside
    # the store's or gloo's C++ code while the interpreter tears down aborts the process (`terminate called without an
    # active exception`, code -6), which its launcher takes for a crash.
    stopping = threading.Event()
    threads: list[threading.Thread] = []

    def start_thread(target, *args) -> None:
        threads.append(threading.Thread(target=target, args=args, daemon=True))
        threads[-1].start()

    if external:
        for key in LAUNCHER_VARIABLES:
            os.environ.pop(key, None)
    else:
        start_thread(_watch_parent, os.getppid(), stopping)
    store = _connect(host, port, worker, connect_timeout_s)
    try:
        spec: WorkerSpec = pickle.loads(store.get("spec"))
        _join(
            store,
            spec,
            worker,
            workers,
            f"{host}:{port}",
            external,
            lambda: start_thread(send_heartbeats, store, worker, stopping),
        )
        from lit_ppo.engine_registry import ENGINES

        started = time.perf_counter()
        engine = ENGINES[spec.engine_name].start_in_worker(spec.engine)
        print(
            f"rollout worker {worker}: {spec.engine_name} engine started in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
        episodes = None
        if spec.episodes is not None:  # multi-turn episodes: the environments are built here, from the run's settings
            from lit_ppo.rollout.episodes import EpisodeRunner

            episodes = EpisodeRunner.from_spec(spec.episodes)
        store.set(f"ready/{worker}", b"1")
        _follow_commands(store, spec, worker, engine, episodes, _address_towards(host, port) if external else host)
        # The weight receiver is joined and its gloo group's pairs closed here, while the trainer (which waits for
        # "stopped") still holds its end.
        engine.close_weight_transfer()
        engine.close()
        stop_threads(stopping, threads)
        store.set(f"stopped/{worker}", b"1")
    except BaseException as e:
        traceback.print_exc()
        sys.stdout.flush()
        last = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        try:
            store.set(f"error/{worker}", last.encode())
        finally:
            os._exit(1)


def main(argv: list[str], prog: str = "python -m lit_ppo.rollout.workers") -> None:
    """The trainer's spawned form `HOST PORT WORKER WORKERS`, or a launcher's
    `--connect HOST:PORT [--worker N] [--workers N]` (rollout.workers.launch=external)."""
    if argv and not argv[0].startswith("-"):
        host, port, worker, workers = argv
        worker_main(host, int(port), int(worker), int(workers))
        return
    import argparse

    parser = argparse.ArgumentParser(
        prog=prog,
        description="A rollout worker started by a launcher (rollout.workers.launch=external, docs/async.md).",
    )
    parser.add_argument(
        "--connect", required=True, metavar="HOST:PORT", help="the trainer's store (the plan prints it)"
    )
    parser.add_argument("--worker", type=int, help="this worker's number, 0..workers-1; default: SLURM_PROCID or RANK")
    parser.add_argument(
        "--workers", type=int, help="checked against the trainer's rollout.workers.count; default: the trainer's"
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
        index = launched_worker_index()
        if index is None or not index.isdigit():
            parser.error("no worker number: give --worker N, or run it under srun (SLURM_PROCID) or torchrun (RANK)")
        worker = int(index)
    worker_main(host, int(port), worker, args.workers, external=True, connect_timeout_s=args.connect_timeout_s)


def run_as_main(argv: list[str], prog: str = "python -m lit_ppo.rollout.workers") -> None:
    """The worker process's entry (`python -m lit_ppo.rollout.workers`)."""
    # Ctrl-C, and the SIGTERM/SIGUSR1 a scheduler sends to every process of a job, are the trainer's to handle: it
    # checkpoints (which needs the workers' batches in flight) and then stops its workers; they end with it anyway.
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    main(argv, prog)
