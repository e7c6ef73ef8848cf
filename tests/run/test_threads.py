"""CPU threads (lit_ppo/run/threads.py): a run's processes take the cores they may use (their affinity, here set with
`taskset`), shared among the ranks of the node, and OpenMP's threads wait passively where other processes compete for
the cores at start (spinning otherwise). Checked through `train.py`'s own start (`mode=plan`: the threads are set
before torch loads, whatever the mode), as its run.log reports them."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2, reason="taskset")


def threads_line(tmp_path: Path, cores: str, *overrides: str, **env: str) -> str:
    """The CPU-threads line of run.log of `taskset -c <cores> python train.py mode=plan <overrides>`."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    command = ["taskset", "-c", cores, sys.executable, "train.py", "mode=plan", f"output_dir={tmp_path}", *overrides]
    result = subprocess.run(command, cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in (tmp_path / "logs" / "run.log").read_text().splitlines() if "CPU threads:" in line]
    assert len(lines) == 1
    return lines[0].split("CPU threads: ", 1)[1]


def spin() -> None:
    while True:
        pass


@contextmanager
def competing_processes(count: int):
    """`count` busy-loop processes (a competing CPU job) for the duration of the block."""
    processes = [multiprocessing.get_context("spawn").Process(target=spin, daemon=True) for _ in range(count)]
    for process in processes:
        process.start()
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.join()


def test_one_allowed_core_beside_a_competing_job_gives_one_thread_that_waits_passively(tmp_path):
    with competing_processes(os.cpu_count()):
        line = threads_line(tmp_path, "0")
    assert line == "1 per process (1 cores allowed, 1 process(es) on this node, OMP_WAIT_POLICY=PASSIVE)"


def test_the_wait_policy_is_passive_only_where_the_cores_are_oversubscribed():
    from lit_ppo.run.threads import oversubscribed

    assert not oversubscribed(2, 0, host_cores=2, allowed=2)  # idle cores: libgomp's spin (2.1x faster, BENCHMARKS.md)
    assert oversubscribed(2, 1, host_cores=2, allowed=2)
    assert oversubscribed(1 * 3, 0, host_cores=2, allowed=2)  # a trainer and 2 rollout workers, 1 thread each
    assert not oversubscribed(8, 8, host_cores=64, allowed=64)  # other jobs on other cores of a large node
    assert oversubscribed(8, 0, host_cores=64, allowed=8)  # a cpuset of 8: the host-wide count cannot tell
    assert not oversubscribed(2, None, host_cores=2, allowed=2)  # no /proc/loadavg: libgomp's default


def threads_of(cores: str, local_processes: int, **env: str) -> str:
    """torch's threads and the wait policy in `taskset -c <cores> python`, after `use_cpu_threads` (the function
    train.py calls; torch alone loads faster than train.py's imports)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    code = (
        "import os; from lit_ppo.run.threads import use_cpu_threads; "
        f"print(use_cpu_threads({local_processes}), os.environ.get('OMP_WAIT_POLICY'))"
    )
    command = ["taskset", "-c", cores, sys.executable, "-c", code]
    env = {**clean, "PYTHONPATH": str(ROOT), **env}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_the_ranks_of_a_node_share_its_cores():
    with competing_processes(os.cpu_count()):
        assert threads_of("0,1", local_processes=2) == "1 PASSIVE"  # two CPU ranks on 2 cores: 1 thread each
        assert threads_of("0,1", local_processes=1) == "2 PASSIVE"


def test_the_users_settings_win():
    assert threads_of("0", local_processes=1, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="ACTIVE") == "2 ACTIVE"
    assert threads_of("0", local_processes=1, GOMP_SPINCOUNT="300000") == "1 None"  # libgomp's own default spin


def test_the_rollout_workers_of_disaggregated_mode_share_the_cores_with_the_trainer(tmp_path):
    """The workers generate while the trainer trains: on 2 cores each process takes 1 thread (2 each had them spin
    against one another: a k = 1 rollout step took 1.30 s instead of the 0.56 s one core each gives)."""
    line = threads_line(tmp_path, "0,1", "rollout.mode=disaggregated")
    assert line.startswith("1 per process (2 cores allowed, 2 process(es) on this node, OMP_WAIT_POLICY=")
    # workers started by the launcher (rollout.workers.launch=external) are on nodes it chose: not counted here
    external = threads_line(
        tmp_path / "external",
        "0,1",
        "rollout.mode=disaggregated",
        "rollout.workers.launch=external",
        "rollout.workers.count=3",
    )
    assert external.startswith("2 per process (2 cores allowed, 1 process(es) on this node, OMP_WAIT_POLICY="), external
