"""Spawned vLLM servers as rollout workers (rollout.workers.launch=server without rollout.workers.server_urls,
docs/async.md): their start (`spawn_server`: `python -m vllm.entrypoints.openai.api_server` in its own process group,
its log `<log_dir>/rollout_server<N>.log` opening with the whole command, lit-ppo's vLLM plugin on its PYTHONPATH where
the installed lit-ppo does not declare it, and PR_SET_PDEATHSIG so that no server outlives its trainer) and their stop
(`stop_spawned`: SIGTERM to each one's process group, SIGKILL for what of it has not exited in time, the group even
where its leader, the API server, is gone already)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lit_ppo.rollout.weight_transfer.plugin import PLUGIN_ENTRY_POINT, plugin_installed
from lit_ppo.rollout.workers.launch import worker_devices
from lit_ppo.rollout.workers.server_http import Server
from lit_ppo.rollout.workers.server_settings import server_arguments, server_variables, shell_line
from lit_ppo.topology import LAUNCHER_VARIABLES

log = logging.getLogger("lit_ppo")

STOP_TIMEOUT_S = 30.0  # a spawned server's SIGTERM, then SIGKILL


def server_environment(kv_cache_gib: float) -> dict[str, str]:
    """What a server needs in its environment beside the trainer's (without the launcher's rendezvous variables,
    which vLLM would join)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(server_variables(kv_cache_gib))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the trainer's in-process setting; a server runs its own core
    return env


def plugin_path(root: Path) -> Path:
    """A folder to put on a spawned server's PYTHONPATH that declares the plugin (a `*.dist-info` with the entry
    point: vLLM finds it with importlib.metadata), for where the installed lit-ppo does not (`plugin_installed`)."""
    dist_info = root / "lit_ppo_vllm_plugin-0.0.0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: lit-ppo-vllm-plugin\nVersion: 0.0.0\n")
    (dist_info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_ENTRY_POINT}\n")
    return root


_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform == "linux" else None  # loaded before any fork


def end_with_parent(trainer_pid: int) -> None:
    """`preexec_fn` of a spawned server: the kernel sends it SIGTERM when the trainer's process ends, however it ends
    (SIGKILL too), and vLLM's server then stops its engine's processes; no server outlives its trainer (Linux; elsewhere
    `close` alone stops it)."""
    if _LIBC is None:
        return
    PR_SET_PDEATHSIG = 1
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != trainer_pid:  # the trainer ended before the call: nobody would send it
        os._exit(1)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_server(
    number: int, settings: dict, devices_per_worker: int, trainer_devices: int, host: str, log_dir: Path
) -> Server:
    """Start server `number` with `VLLMEngine`'s `settings` (`rollout.engine.worker_settings`) on a free port of `host`; its
    log in `log_dir`. Returns at once: the client waits for its /health."""
    port = free_port(host)
    env = server_environment(settings["kv_cache_gib"])
    # The server imports this checkout of lit_ppo (the plugin's module), whatever is installed.
    paths = [str(Path(__file__).resolve().parents[3])]
    if not plugin_installed():
        paths.insert(0, str(plugin_path(log_dir / "vllm_plugin")))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    devices = worker_devices(env, number, devices_per_worker, trainer_devices)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    log_file = log_dir / f"rollout_server{number}.log"
    # `python -m`, not the `vllm` command: the CPU wheel's command cannot find its own distribution (docs/async.md).
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += server_arguments(settings, port, host)
    # The whole command with the variables it gets beside the trainer's, to start the same server by hand.
    variables = server_variables(settings["kv_cache_gib"])
    variables.update({k: env[k] for k in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES") if k in env})
    with open(log_file, "ab") as out:
        out.write(f"$ {shell_line(variables, command)}\n".encode())
        out.flush()
        process = subprocess.Popen(
            command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: `close` signals the server and its engine's processes
            preexec_fn=functools.partial(end_with_parent, os.getpid()),
        )
    server = Server(number, f"http://{host}:{port}", process, log_file)
    log.info("rollout worker %d: vLLM server starting at %s (log: %s)", number, server.url, log_file)
    return server


def stop_spawned(servers: list[Server], failed: bool, timeout_s: float = STOP_TIMEOUT_S) -> list[int | None]:
    """Stop the spawned ones of `servers` (given ones are left alone): every group signalled first (at once with
    SIGKILL after a failure), then one deadline; SIGKILL for a group not ended by then. Returns their exit codes (None:
    it did not exit by the deadline)."""
    spawned = [s for s in servers if s.process is not None]
    for server in spawned:
        signal_group(server.process.pid, signal.SIGKILL if failed else signal.SIGTERM)
    deadline = time.monotonic() + (0.0 if failed else timeout_s)
    exit_codes = []
    for server in spawned:
        try:
            code = server.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code is None or not group_ended(server.process.pid, deadline - time.monotonic()):
            signal_group(server.process.pid, signal.SIGKILL)
            server.process.wait()
            group_ended(server.process.pid, STOP_TIMEOUT_S)
        exit_codes.append(code)
    return exit_codes


def signal_group(pid: int, signum: int) -> None:
    """`signum` to a spawned server's process group (its engine's processes too), by the group's id, which is the
    server's pid (start_new_session) and stays the group's while any of its processes lives, the server's own exit
    and reaping included; gone already is fine."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies not counted: an orphan's waits for its reaper)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: any member, zombies too
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            return True
    return False


def group_ended(pgid: int, timeout_s: float) -> bool:
    """Whether group `pgid` has no running process within `timeout_s`."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
