"""One run per directory at any moment: `<output_dir>/.lit_ppo.lock`, held for the run's life by the process that
owns the directory (rank 0, the launcher's). A second run started into the same directory (a doubled submission, a
requeue while the old job still runs, `mode=plan` beside a training run) is refused in one line before it writes
anything there.

The lock is a file made whole or not at all: its content is written to a file of its own, then hard-linked to the
lock's name, which fails when the name exists (atomic on local disks and on NFS, where `flock` is often a no-op or
local to one client); where hard links are not supported, `O_CREAT | O_EXCL`. It records the holder's host, pid,
the process's start time and the host's boot (so a reused pid or a rebooted host is not taken for the holder), the
time and the SLURM job. It is released when the run ends: normally, with an error, or on SIGTERM, SIGINT and SIGUSR1
(which end the process by an exception: `lit_ppo.signals`, `lit_ppo.preemption`). A process killed outright (SIGKILL,
a lost node) leaves it: the next run takes it over, with a line, where the holder is known to be gone (no such
process on this host, this host restarted since, or an earlier start of the same SLURM job, requeued). A lock held
from another host whose job is not this one cannot be checked from here: refused, with the way on.

`train.py`'s Hydra callback (`directories.RunDirectoryCheck`) takes it before Hydra writes into the directory, and
holds it until the process exits; `run/entry.py:run` takes it for callers without Hydra's run (the tests, the
benchmarks, each job of a sweep) and finds it held already under `train.py`.

Imports nothing heavy: the callback runs before torch loads (lit_ppo/run/threads.py).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from lit_ppo.errors import DirectoryError
from lit_ppo.topology import launcher_rank

log = logging.getLogger("lit_ppo")

LOCK_NAME = ".lit_ppo.lock"


def _read(path: Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _process_start(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since the host's boot (/proc/<pid>/stat); None where it does not
    run or this is not Linux, "zombie" for a process that has ended but was not reaped."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command's name, which may hold spaces
    return "zombie" if fields[0] in "ZX" else fields[19]


def _pid_namespace() -> str | None:
    """This process's PID namespace (a container has its own: its pids are not the host's, nor another container's
    on the same host, whose host name and boot id may be the host's: `--network host`)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def same_pid_namespace(holder: dict, me: dict) -> bool:
    """Whether the lock's process can be looked up by its pid from `me` (a lock of an earlier release records none)."""
    return (
        not (holder.get("pid_namespace") and me.get("pid_namespace")) or holder["pid_namespace"] == me["pid_namespace"]
    )


def this_process() -> dict:
    """What a lock records of the process that takes it."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "boot_id": _read(Path("/proc/sys/kernel/random/boot_id")),
        "pid_namespace": _pid_namespace(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "").strip() or 0),
        "token": uuid.uuid4().hex,
    }


def gone(holder: dict, me: dict) -> str | None:
    """Why the process `holder` (a lock's record) is known to have ended, seen from the process `me`; None where it
    runs or cannot be checked from here."""
    if holder.get("slurm_job_id") and holder.get("slurm_job_id") == me["slurm_job_id"]:
        if int(holder.get("slurm_restart_count") or 0) < me["slurm_restart_count"]:
            return f"an earlier start of SLURM job {me['slurm_job_id']}, which was requeued"
    if holder.get("host") != me["host"]:
        return None
    if holder.get("boot_id") and me["boot_id"] and holder["boot_id"] != me["boot_id"]:
        return "the host restarted since"
    pid = holder.get("pid")
    if not isinstance(pid, int) or not same_pid_namespace(holder, me):  # another container's pid: not ours to look up
        return None
    if pid == me["pid"]:
        if holder.get("process_start") != me["process_start"]:  # a requeued container given the same pid
            return "no such process (this pid is now this run's)"
        return None
    start = _process_start(pid)
    if start == "zombie":
        return "the process has ended"
    if start is not None:
        recorded = holder.get("process_start")
        return None if recorded is None or recorded == start else "no such process (its pid is another's now)"
    try:  # no /proc/<pid>/stat to read (not Linux, or /proc hides other users' processes): a process with this pid?
        os.kill(pid, 0)
    except ProcessLookupError:
        return "no such process"
    except PermissionError:
        pass
    return None


def describe(holder: dict) -> str:
    slurm = f" (SLURM job {holder['slurm_job_id']})" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{slurm} since {holder.get('started')}"


def _create(path: Path, record: dict) -> bool:
    """Make the lock file with `record` in it, whole; False where it exists."""
    text = json.dumps(record, indent=1) + "\n"
    staged = path.with_name(f"{path.name}.{record['token']}.tmp")  # beside it: a hard link stays on one file system
    staged.write_text(text)
    try:
        os.link(staged, path)
        return True
    except FileExistsError:
        # NFS may redo a link whose answer was lost, and answer EEXIST to the one that made it
        return os.stat(staged).st_nlink == 2
    except OSError:  # no hard links on this file system
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(handle, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return True
    finally:
        staged.unlink(missing_ok=True)


def _load(path: Path) -> dict | None:
    """The lock's record; None where it is gone; {} where it cannot be read as one."""
    if not path.exists():
        return None
    text = _read(path)
    if text is None and not path.exists():
        return None
    try:
        record = json.loads(text or "")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _set_aside(path: Path, holder: dict, token: str) -> bool:
    """Remove the lock `holder` of a process that is gone; False where another process removed or replaced it first.
    Moved aside by a rename, which one process alone can do, then checked: a fresh lock of another process that
    took it over in between is put back."""
    aside = path.with_name(f"{path.name}.{token}.stale")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    moved = _load(aside) or {}
    if moved.get("token") != holder.get("token"):
        try:
            os.link(aside, path)
        except OSError:
            pass
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


class RunLock:
    """The lock of one run directory, held by this process (`acquire`); `release` removes it if it is still ours."""

    def __init__(self, path: Path, record: dict, note: str | None, made: tuple[Path, ...] = ()):
        self.path, self.record = path, record
        self.note = note  # the line said when a gone run's lock was taken over
        self.made = made  # the directories the lock made (deepest first): removed again if the run left them empty

    def release(self) -> None:
        if os.getpid() != self.record["pid"]:  # a forked child: the lock is its parent's
            return
        holder = _load(self.path)
        if holder and holder.get("token") == self.record["token"]:
            self.path.unlink(missing_ok=True)
            for directory in self.made:  # a run refused by its pre-flight leaves no empty output_dir behind
                try:
                    directory.rmdir()
                except OSError:  # not empty: the run wrote there
                    break


def acquire(output_dir: Path, key: str = "output_dir") -> RunLock:
    """Take the lock of `output_dir` (`key`: the setting that named it) for this process: a DirectoryError in one line
    where another run holds it; a lock whose run is gone is taken over, with a line (`RunLock.note`)."""
    output_dir = Path(output_dir)
    path = output_dir / LOCK_NAME
    made = tuple(d for d in (output_dir, *output_dir.parents) if not d.exists())
    output_dir.mkdir(parents=True, exist_ok=True)
    me, note = this_process(), None
    fix = f"wait for it to end, or give this run another {key}"
    for _ in range(5):  # each round: someone else removed or replaced the lock while we looked
        try:
            if _create(path, me):
                return RunLock(path, me, note, made)
        except OSError as e:  # a full disk, a directory made read-only since its check
            raise DirectoryError(
                f"{key}={output_dir}: its lock {path} cannot be written ({e.strerror or type(e).__name__}); fix: free "
                f"space there or make it writable, or give the run another {key}"
            ) from None
        holder = _load(path)
        if holder is None:
            continue
        if not holder:
            raise DirectoryError(
                f"{key}={output_dir} holds a lock file that is not a run's ({path}): another run may be starting in "
                f"it; fix: {fix}, or remove {path} if no run uses the directory"
            )
        reason = gone(holder, me)
        if reason is None:
            where = (
                "which runs"
                if holder.get("host") == me["host"] and same_pid_namespace(holder, me)
                else "which cannot be checked from this host (or this container); if that run is gone (killed, its "
                "node lost), "
                f"remove {path} and start again"
            )
            raise DirectoryError(
                f"{key}={output_dir} is in use by another run: {describe(holder)}, {where} ({path}); fix: {fix}"
            )
        if _set_aside(path, holder, me["token"]):
            note = f"{key}={output_dir}: took over the lock of a run that is gone ({describe(holder)}: {reason})"
    raise DirectoryError(f"{key}={output_dir}: its lock {path} keeps changing: several runs start in it; fix: {fix}")


_held: dict[str, RunLock] = {}  # the run directories this process holds, by their real path


def hold_until_exit(output_dir: Path, key: str = "output_dir") -> RunLock | None:
    """Take the lock of `output_dir` for the rest of this process (rank 0 only; None on other ranks), released at its
    exit: `train.py`'s Hydra callback, before Hydra writes into the directory."""
    if launcher_rank() != 0:
        return None
    directory = os.path.realpath(output_dir)
    if directory not in _held:
        lock = _held[directory] = acquire(output_dir, key)
        atexit.register(lock.release)
    return _held[directory]


@contextmanager
def run_lock(output_dir: Path, key: str = "output_dir") -> Iterator[None]:
    """Hold the lock of `output_dir` while the block runs (rank 0 only), unless this process holds it already."""
    directory = os.path.realpath(output_dir)
    if launcher_rank() != 0:
        yield
        return
    if directory in _held:
        if _held[directory].note:  # said on the console by the callback, before run.log was opened
            log.info(_held[directory].note, extra={"console": False})
        yield
        return
    lock = acquire(output_dir, key)
    if lock.note:
        from lit_ppo.console import show

        show(lock.note)
    _held[directory] = lock
    try:
        yield
    finally:
        del _held[directory]
        lock.release()
