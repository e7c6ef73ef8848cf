"""One run per directory at any moment (lit_ppo/run/lock.py): a second run into a held output_dir is refused in one
line, a lock whose run is gone is taken over with a line, and the lock is released when the run ends, however."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from lit_ppo.errors import DirectoryError
from lit_ppo.run.entry import run
from lit_ppo.run.lock import LOCK_NAME, acquire, run_lock, this_process
from tests.helpers import ROOT, compose_run_config

HOLD = textwrap.dedent(
    """
    import sys
    from lit_ppo.run.lock import acquire
    lock = acquire(sys.argv[1])
    print("held", flush=True)
    sys.stdin.readline()
    if sys.argv[2] == "release":
        lock.release()
    """
)


def holder_process(directory, release: bool = True) -> subprocess.Popen:
    """Another process that holds the lock of `directory` until its stdin is closed."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), "release" if release else "keep"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "held"
    return process


def write_lock(directory, **changes) -> dict:
    """A lock file as another process would have left it: this process's record with `changes`."""
    record = {**this_process(), **changes}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_NAME).write_text(json.dumps(record))
    return record


def test_a_second_run_into_a_held_directory_is_refused_in_one_line_until_the_first_ends(tmp_path):
    out = tmp_path / "run"
    first = holder_process(out)
    try:
        with pytest.raises(DirectoryError) as refused:
            acquire(out)
        line = str(refused.value)
        assert "\n" not in line
        assert f"output_dir={out} is in use by another run: pid {first.pid} on host {socket.gethostname()}" in line
        assert "which runs" in line and "another output_dir" in line, line
    finally:
        first.communicate("\n", timeout=30)
    assert first.returncode == 0 and not (out / LOCK_NAME).exists()  # released at its end
    acquire(out).release()


def test_a_second_process_is_refused_while_a_run_of_this_process_holds_the_directory(tmp_path):
    """Both sides in their own process: the second `python -c` calls the lock while the first (this one) holds it."""
    out = tmp_path / "run"
    second = [sys.executable, "-c", f"from lit_ppo.run.lock import acquire; acquire({str(out)!r})"]
    with run_lock(out):
        refused = subprocess.run(second, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and f"is in use by another run: pid {os.getpid()}" in refused.stderr
    assert not (out / LOCK_NAME).exists()
    taken = subprocess.run(second, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert taken.returncode == 0, taken.stderr


def test_the_lock_of_a_killed_run_on_this_host_is_taken_over_with_a_line(tmp_path):
    """SIGKILL (or a lost node) leaves the lock; its pid runs no more on this host: the next run takes it over."""
    out = tmp_path / "run"
    killed = holder_process(out, release=False)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=30)
    left = json.loads((out / LOCK_NAME).read_text())
    lock = acquire(out)
    assert lock.note == (
        f"output_dir={out}: took over the lock of a run that is gone (pid {killed.pid} on host "
        f"{socket.gethostname()} since {left['started']}: no such process)"
    )
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / LOCK_NAME).exists()


def test_gone_holders_taken_over_live_or_unknown_ones_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    me = this_process()

    def outcome(**changes) -> str:
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        write_lock(directory, **changes)
        try:
            lock = acquire(directory)
        except DirectoryError as error:
            return f"refused: {error}"
        lock.release()
        return f"taken: {lock.note}"

    # a live process of this host (this test's parent), started when it started: refused
    parent = os.getppid()
    with open(f"/proc/{parent}/stat") as f:
        parent_start = f.read().rsplit(")", 1)[1].split()[19]
    assert "which runs" in outcome(pid=parent, process_start=parent_start)
    # the same pid, now another process's (a requeued container that got it again): taken over
    assert "its pid is another's now" in outcome(pid=parent, process_start="1")
    assert "this pid is now this run's" in outcome(pid=os.getpid(), process_start="1")
    # this host rebooted since the lock was written: taken over
    assert "the host restarted since" in outcome(pid=parent, process_start=parent_start, boot_id="another-boot")
    # another host: its process cannot be checked from here: refused, with the way on
    elsewhere = outcome(host="node-elsewhere", pid=4242)
    assert elsewhere.startswith("refused:") and "pid 4242 on host node-elsewhere" in elsewhere
    assert "cannot be checked from this host" in elsewhere and f"remove {tmp_path}" in elsewhere, elsewhere
    # another container on this host (`--network host`: the host's name and boot id, its own pids), even the same pid
    # (python as PID 1 in both): its process cannot be looked up from here: refused, never taken over
    for pid in (4242, os.getpid()):
        container = outcome(pid=pid, process_start="1", pid_namespace="pid:[1]")
        assert container.startswith("refused:") and "cannot be checked from this host (or this container)" in container
    # a pid that no process of this host has (not readable in /proc, not signalable): gone
    assert "no such process" in outcome(pid=2**22 + 12345, process_start="1")
    # an earlier start of this SLURM job, on another node, before a requeue: gone
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    requeued = outcome(host="node-elsewhere", pid=4242, slurm_job_id="77", slurm_restart_count=0)
    assert "an earlier start of SLURM job 77, which was requeued" in requeued, requeued
    # the same start of that job (two runs of one job script into one directory), or another job: refused
    assert "(SLURM job 77)" in outcome(host="node-elsewhere", pid=4242, slurm_job_id="77", slurm_restart_count=1)
    assert outcome(host="node-elsewhere", pid=4242, slurm_job_id="78").startswith("refused:")
    # a lock file that is not a run's (empty, half-written by hand): refused, not taken
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / LOCK_NAME).write_text("")
    with pytest.raises(DirectoryError, match="holds a lock file that is not a run's"):
        acquire(tmp_path / "empty")
    assert me["pid"] == os.getpid()


def test_the_lock_is_released_after_an_error_and_held_only_by_rank_zero(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="the run failed"):
        with run_lock(out):
            assert (out / LOCK_NAME).exists()
            raise RuntimeError("the run failed")
    assert not (out / LOCK_NAME).exists()
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank Lightning's launcher started: the directory is rank 0's
    with run_lock(out):
        assert not (out / LOCK_NAME).exists()


def test_run_refuses_a_held_directory_before_the_plan_and_releases_its_own(tmp_path):
    """The one road of every run (run/entry.py:run): mode=plan too, which writes plan.json into output_dir."""
    out = tmp_path / "run"
    config = compose_run_config("mode=plan")
    write_lock(out, host="node-elsewhere")
    with pytest.raises(DirectoryError, match="is in use by another run"):
        run(config, out)
    assert not (out / "plan.json").exists()
    (out / LOCK_NAME).unlink()
    run(config, out)
    assert (out / "plan.json").exists() and not (out / LOCK_NAME).exists()


def test_train_py_refuses_a_held_output_dir_in_one_line_with_exit_2_and_writes_nothing_there(tmp_path):
    """Refused by train.py's Hydra callback, before Hydra writes its .hydra/ files into the first run's directory."""
    out = tmp_path / "run"
    command = [sys.executable, "train.py", "mode=plan", f"output_dir={out}"]
    with run_lock(out):
        refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2, refused.stderr[-3000:]
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: output_dir={out} is in use by another run: pid "), lines
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    planned = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert (out / "plan.json").exists() and not (out / LOCK_NAME).exists()  # released at the process's exit
