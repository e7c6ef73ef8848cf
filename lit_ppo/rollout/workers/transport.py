"""The channel between the trainer and its rollout workers (docs/async.md), used from both sides.

- A TCPStore that the trainer hosts carries the small things: each worker's start signal, its ordered commands
  (`cmd/<worker>/<n>`: generate a request, apply a received weight version, stop) and its answers (`result/...`,
  pickled generations), all as the frozen dataclasses of `messages`. A store and not a multiprocessing queue: it works
  the same when a worker runs on another node (it connects to `host:port`), and every wait on it can be bounded and
  interleaved with a liveness check.
- A torch.distributed process group of its own (gloo; built from the store, never the default group, which vLLM
  and Lightning use) carries the weights, through vLLM's weight-transfer interface (`weight_transfer`: the trainer
  broadcasts each version in flat byte buckets, a thread in each worker receives them while its engine generates,
  and the worker loads a version when its ordered commands reach it).
"""

from __future__ import annotations

import datetime
import time

import torch

POLL_S = 0.01  # how often a wait looks at the store (and, on the trainer's side, at the workers' liveness)


def seconds_delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def gloo_group(store, rank: int, size: int, timeout_s: float, host: str):
    """A gloo process group of its own over `store` (not torch.distributed's default group)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = seconds_delta(timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("weights/", store), rank, size, options)


def broadcast(group, tensor: torch.Tensor) -> None:
    """Rank 0's (the trainer's) `tensor` into every worker's."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def take_key(store, key: str) -> bytes:
    """A worker's wait for its next command: the value of `key` once set, then deleted (the trainer's waits are
    bounded and watch liveness instead: `RolloutWorkers`)."""
    while not store.check([key]):
        time.sleep(POLL_S)
    value = store.get(key)
    store.delete_key(key)
    return value
