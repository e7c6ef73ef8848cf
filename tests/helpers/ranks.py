"""Several torch.distributed ranks in one test: `start_ranks`."""

from __future__ import annotations

import faulthandler
import multiprocessing
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

RANKS_TIMEOUT_S = 900.0
"""How long the ranks of one `start_ranks` may run: a rank still running then prints its threads' stacks and the
test fails (a hang in a collective or in a rank's start becomes a failure that says where, not a stalled suite)."""


def _rank(rank: int, fn, timeout_s: float, stacks: str, *args) -> None:
    """One rank: `fn(rank, *args)`; past `timeout_s` its stacks go to `stacks/rank<r>.txt` and the process ends (a
    file, not stderr: a rank's stderr is the fork server's, an earlier test's captured stream)."""
    with open(Path(stacks, f"rank{rank}.txt"), "w") as out:
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=out)
        try:
            fn(rank, *args)
        finally:
            faulthandler.cancel_dump_traceback_later()


def start_ranks(fn, nprocs: int, *args, timeout_s: float = RANKS_TIMEOUT_S) -> None:
    """Runs `fn(rank, *args)` in `nprocs` processes and waits for them. The processes come from a fork server, not a
    fork of pytest's process: that one may run the session's in-process vLLM engine (its threads and its
    torch.distributed group; a fork of it crashes with SIGSEGV). The server imports `fn`'s module once (preloaded), so
    each rank starts without importing lit_ppo again (about 40 s a rank if spawned). A rank running past `timeout_s`
    prints its stacks and ends; a rank that never starts is ended here: either way the test fails with the ranks named."""
    multiprocessing.set_forkserver_preload([__name__, fn.__module__])
    with tempfile.TemporaryDirectory(prefix="ranks-") as stacks:
        context = mp.start_processes(
            _rank, args=(fn, timeout_s, stacks, *args), nprocs=nprocs, join=False, start_method="forkserver"
        )
        try:
            _wait(context, nprocs, fn, timeout_s)
        except mp.ProcessExitedException as exited:
            dumped = {f.name: f.read_text() for f in sorted(Path(stacks).glob("rank*.txt")) if f.stat().st_size}
            if not dumped:
                raise
            raise AssertionError(
                f"{fn.__name__}: ranks ran past {timeout_s:.0f} s, their stacks:\n"
                + "\n".join(f"{name}:\n{text}" for name, text in dumped.items())
            ) from exited


def _wait(context, nprocs: int, fn, timeout_s: float) -> None:
    """Joins the ranks; ends those still running (never started?) 30 s after their own timeouts."""
    deadline = time.monotonic() + timeout_s + 30.0  # the ranks' own timeouts first, with their stacks
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            stuck = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(
                f"ranks {stuck} of {nprocs} ({fn.__name__}) still running {timeout_s + 30:.0f} s after they were "
                "started, without printing their stacks: stuck before their first line (the fork server's start?)"
            )
