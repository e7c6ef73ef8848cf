"""Several torch.distributed ranks in one test: `start_ranks`."""

from __future__ import annotations

import multiprocessing

import torch.multiprocessing as mp


def start_ranks(fn, nprocs: int, *args) -> None:
    """Runs `fn(rank, *args)` in `nprocs` processes and waits for them. The processes come from a fork server, not a
    fork of pytest's process: that one may run the session's in-process vLLM engine (its threads and its
    torch.distributed group; a fork of it crashes with SIGSEGV). The server imports `fn`'s module once (preloaded), so
    each rank starts without importing lit_ppo again (about 40 s a rank if spawned)."""
    multiprocessing.set_forkserver_preload([fn.__module__])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
