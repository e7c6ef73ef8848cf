"""The rollout worker process (lit_ppo/rollout/workers/worker_main.py) before and after its engine: a worker given
a wrong number or address stops in one line, the old command still starts one, and a worker that stops its threads
exits 0. Its runs with an engine are tests/rollout/test_async.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.helpers import ROOT, free_port


def test_an_external_worker_given_a_wrong_number_or_address_stops_in_one_line(tmp_path):
    """Before any engine starts (a store standing in for the trainer's): a number outside 0..workers-1, a number
    already taken, no number at all, an address nobody listens on: each worker stops with one line saying the fix."""
    import datetime
    import pickle

    import torch.distributed as dist

    from lit_ppo.rollout.workers.messages import WorkerSpec

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    store.set("spec", pickle.dumps(WorkerSpec(engine={}, push_timeout_s=30.0, max_logprob_abs_diff=None, workers=2)))
    store.add("claim/1", 1)  # worker 1 connected already
    no_launcher = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID")}

    def worker(*args: str) -> tuple[int, str]:
        """Its exit code and the last line it printed (argparse's errors: of stderr)."""
        command = [sys.executable, "-m", "lit_ppo.rollout.workers", *args]
        done = subprocess.run(command, cwd=ROOT, env=no_launcher, capture_output=True, text=True, timeout=120)
        return done.returncode, (done.stdout.strip() or done.stderr.strip()).splitlines()[-1]

    assert worker("--connect", f"127.0.0.1:{store.port}", "--worker", "2") == (
        2,
        f"rollout worker 2: the trainer at 127.0.0.1:{store.port} expects rollout.workers.count=2 (numbers 0..1); "
        "fix: start that many workers, numbered from 0",
    )
    assert worker("--connect", f"127.0.0.1:{store.port}", "--worker", "0", "--workers", "3")[1].startswith(
        "rollout worker 0 of --workers 3: the trainer at"
    )
    code, _ = worker("--connect", f"127.0.0.1:{store.port}", "--worker", "1")
    assert code == 1 and store.get("error/1").decode() == (
        "RuntimeError: rollout worker 1: another worker connected as number 1 already; fix: give each worker its own "
        "--worker (or SLURM_PROCID / RANK)"
    )
    code, line = worker("--connect", f"127.0.0.1:{store.port}")
    assert code == 2 and line.endswith(
        "error: no worker number: give --worker N, or run it under srun (SLURM_PROCID) or torchrun (RANK)"
    )
    port = free_port()
    code, line = worker("--connect", f"127.0.0.1:{port}", "--worker", "0", "--connect-timeout-s", "1")
    assert code == 2 and line.startswith(f"rollout worker 0: could not connect to the trainer at 127.0.0.1:{port}")
    assert line.endswith("or raise --connect-timeout-s"), line


def test_the_old_worker_command_still_works_for_one_release_and_says_so():
    """`python -m lit_ppo.rollout.disaggregated` (before the workers became a package) runs a worker as
    `python -m lit_ppo.rollout.workers` does, after one line naming the new command."""
    port = free_port()
    command = [sys.executable, "-m", "lit_ppo.rollout.disaggregated", "--connect", f"127.0.0.1:{port}", "--worker", "0"]
    done = subprocess.run(command + ["--connect-timeout-s", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert lines[0] == (
        "python -m lit_ppo.rollout.disaggregated is now python -m lit_ppo.rollout.workers; the old name goes in the "
        "next release"
    )
    assert done.returncode == 2 and lines[-1].startswith(
        f"rollout worker 0: could not connect to the trainer at 127.0.0.1:{port}"
    )


WORKER_THREADS_AT_EXIT = """
import sys, threading, time, datetime
import torch.distributed as dist
from lit_ppo.rollout.weight_transfer.transport import StagedReceiver
from lit_ppo.rollout.workers.worker_main import send_heartbeats, stop_threads

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
stopping = threading.Event()
# a worker's threads as it runs them (the receiver polling the store for a push, the heartbeat counting up), and one
# that is always inside a store call, as a receiver is at some moment on a slow or loaded machine
def always_in_the_store():
    while not stopping.is_set():
        client.check(["push/0/0"])

threads = [StagedReceiver(client, None, stopping)]
threads.append(threading.Thread(target=send_heartbeats, args=(client, 0, stopping), daemon=True))
threads.append(threading.Thread(target=always_in_the_store, daemon=True))
for thread in threads:
    thread.start()
time.sleep(0.3)
if sys.argv[1] == "stop":
    stop_threads(stopping, threads)
"""


def test_a_worker_that_stops_its_threads_exits_0_where_leaving_them_running_aborts(tmp_path):
    """The mechanism behind `terminate called without an active exception` at a worker's end, without an engine: a
    daemon thread inside a store call while the interpreter finalizes is unwound through C++ frames that must not
    unwind (SIGABRT, -6). With `stop_threads`, as worker_main ends, every run exits 0; left running, as before the fix,
    the same threads abort the process (the old worker lost this race at random: every time on a slow machine)."""
    script = tmp_path / "threads_at_exit.py"
    script.write_text(WORKER_THREADS_AT_EXIT)

    def code(how: str) -> tuple[int, str]:
        done = subprocess.run([sys.executable, str(script), how], cwd=ROOT, capture_output=True, text=True, timeout=60)
        return done.returncode, done.stderr

    stopped = [code("stop") for _ in range(5)]
    assert all(rc == 0 for rc, _ in stopped), stopped
    left = [code("leave") for _ in range(3)]
    assert all(rc == -signal.SIGABRT and "terminate called" in err for rc, err in left), left
