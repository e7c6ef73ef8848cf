"""CPU threads: each process of a run computes with the cores it may use (its affinity, what `taskset`, SLURM's
`--cpus-per-task` or a container's cpuset grant, not the host's count), shared among the processes of its node, and
its OpenMP threads sleep when they wait instead of spinning where other processes already compete for the cores.

Why: torch's OpenMP pool (libgomp) takes a thread per allowed core and, at each parallel region's end, spins waiting
for the slowest thread. A second CPU job on the same cores (another run, a test, a compiler) keeps descheduling one
of the threads, and the others then spin through their time slices: a warm start on a busy 2-core machine ran 4-15x
slower than idle (13-30x on earlier machines). With `OMP_WAIT_POLICY=PASSIVE` a waiting thread yields its core at
once, but on idle cores that costs: every parallel region then ends in a sleep and a wake-up, and the same warm start
took 2.1x as long (bench/contention.py, BENCHMARKS.md). So the policy follows the machine at start: PASSIVE when, with
the threads of the run's processes on this node, more threads want to run than the host has cores (`/proc/loadavg`'s
runnable count, sampled a few times), or when the process may use fewer cores than the host has (the host-wide count
cannot tell whether those cores are busy); libgomp's own spin otherwise. Ranks on one node share its cores (two CPU ranks on 2 cores take 1 thread
each, not 2 each).

Settings the user made win: OMP_NUM_THREADS and MKL_NUM_THREADS are only set when absent, and the wait policy is
left alone when OMP_WAIT_POLICY or GOMP_SPINCOUNT is set (`OMP_WAIT_POLICY=PASSIVE` for a machine that becomes busy
after the run started).
"""

from __future__ import annotations

import os
import time


def allowed_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_process(local_processes: int) -> int:
    """Each of the node's `local_processes` processes takes an equal share of the allowed cores, at least one."""
    return max(1, allowed_cores() // max(1, local_processes))


def other_runnable_processes(samples: int = 5, interval_s: float = 0.01) -> int | None:
    """Processes (threads) of the host that are running or waiting to run, this one left out: the median of a few
    readings of /proc/loadavg's runnable count (it moves at every tick). None where there is no /proc/loadavg."""
    readings = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                runnable = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        readings.append(max(0, runnable - 1))
        if i + 1 < samples:
            time.sleep(interval_s)
    return sorted(readings)[len(readings) // 2]


def oversubscribed(threads: int, others_runnable: int | None, host_cores: int, allowed: int) -> bool:
    """Whether the node's run's `threads` (every local process's) and the others that want to run now exceed the
    host's cores (spinning threads would then burn the time slices of the threads they wait for). A process allowed
    fewer cores than the host has (a container's cpuset, SLURM's --cpus-per-task) cannot tell from the host-wide
    count whether its own cores are busy: it waits passively."""
    if allowed < host_cores:
        return True
    return others_runnable is not None and threads + others_runnable > host_cores


def set_thread_environment(local_processes: int) -> None:
    """OpenMP's and MKL's settings, read once when torch loads them: call before `import torch`. The process's
    children (the ranks Lightning starts, vLLM's and the reward's workers) inherit them."""
    threads = str(threads_per_process(local_processes))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        host_cores = os.cpu_count() or allowed_cores()
        mine = os.environ["OMP_NUM_THREADS"]
        mine = int(mine) if mine.isdigit() else int(threads)  # not a plain number (a nested list "4,2"): the share
        # The node's other processes of this run start after this check: count their threads too.
        if oversubscribed(mine * local_processes, other_runnable_processes(), host_cores, allowed_cores()):
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def use_cpu_threads(local_processes: int) -> int:
    """Set the environment, then torch's intra-op threads (also where torch was imported before); returns them."""
    set_thread_environment(local_processes)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return torch.get_num_threads()
