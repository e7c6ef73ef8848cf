"""CPU threads: each process of a run computes with the cores it may use (its affinity, what `taskset`, SLURM's
`--cpus-per-task` or a container's cpuset grant, not the host's count), shared among the processes of its node, and
its OpenMP threads sleep when they wait instead of spinning.

Why: torch's OpenMP pool (libgomp) takes a thread per allowed core and, at each parallel region's end, spins waiting
for the slowest thread. A second CPU job on the same cores (another run, a test, a compiler) keeps descheduling one
of the threads, and the others then spin through their time slices: a warm start on a busy 2-core machine ran 13-30x
slower. With `OMP_WAIT_POLICY=PASSIVE` a waiting thread yields its core at once (bench/contention.py measures both).
Ranks on one node share its cores (two CPU ranks on 2 cores take 1 thread each, not 2 each).

Settings the user made win: OMP_NUM_THREADS and MKL_NUM_THREADS are only set when absent, and the wait policy is
left alone when OMP_WAIT_POLICY or GOMP_SPINCOUNT is set.
"""

from __future__ import annotations

import os


def allowed_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_process(local_processes: int) -> int:
    """Each of the node's `local_processes` processes takes an equal share of the allowed cores, at least one."""
    return max(1, allowed_cores() // max(1, local_processes))


def set_thread_environment(local_processes: int) -> None:
    """OpenMP's and MKL's settings, read once when torch loads them: call before `import torch`. The process's
    children (the ranks Lightning starts, vLLM's and the reward's workers) inherit them."""
    threads = str(threads_per_process(local_processes))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def use_cpu_threads(local_processes: int) -> int:
    """Set the environment, then torch's intra-op threads (also where torch was imported before); returns them."""
    set_thread_environment(local_processes)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return torch.get_num_threads()
