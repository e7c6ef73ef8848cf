"""The channel between the trainer and its rollout workers (docs/async.md), used from both sides.

- A TCPStore that the trainer hosts carries the small things: each worker's start signal, its ordered commands
  (`cmd/<worker>/<n>`: generate a request, apply a received weight version, stop) and its answers (`result/...`,
  pickled generations), all as the frozen dataclasses of `messages`. A store and not a multiprocessing queue: it works
  the same when a worker runs on another node (it connects to `host:port`), and every wait on it can be bounded and
  interleaved with a liveness check.
- A torch.distributed process group of its own (gloo; built from the store, never the default group, which vLLM
  and Lightning use) carries the weights: the trainer broadcasts the actor's tensors (with model.lora: only the
  adapter's) in flat byte buckets of at most rollout.workers.weight_push_bucket_mib, never through the disk. A thread in each
  worker (`WeightReceiver`) receives them as soon as they are sent, while its engine generates, so a push costs the
  trainer the transfer only; the worker applies a version when its ordered commands reach it.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from typing import Iterable

import torch

from lit_ppo.rollout.workers.messages import BucketHeader

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


def weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterable[tuple[list[tuple[str, str, list[int]]], torch.Tensor]]:
    """The tensors packed into flat byte buckets of at most `bucket_bytes` (a larger tensor is a bucket of its own):
    (per tensor: name, dtype, shape; the bucket's uint8 bytes). Streamed: one bucket's tensors are held at a time,
    so a gathered FSDP tensor is freed once packed."""
    entries, parts, size = [], [], 0
    for name, tensor in named_tensors:
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if parts and size + nbytes > bucket_bytes:
            yield entries, torch.cat(parts)
            entries, parts, size = [], [], 0
        entries.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)))
        parts.append(tensor.cpu().reshape(-1).view(torch.uint8))
        size += nbytes
    if parts:
        yield entries, torch.cat(parts)


def unpack_bucket(entries: list[tuple[str, str, list[int]]], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one bucket received as bytes (views into `flat`)."""
    tensors, offset = [], 0
    for name, dtype, shape in entries:
        dtype = getattr(torch, dtype)
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        tensors.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
        offset += nbytes
    return tensors


def take_key(store, key: str) -> bytes:
    """A worker's wait for its next command: the value of `key` once set, then deleted (the trainer's waits are
    bounded and watch liveness instead: `RolloutWorkers`)."""
    while not store.check([key]):
        time.sleep(POLL_S)
    value = store.get(key)
    store.delete_key(key)
    return value


class WeightReceiver(threading.Thread):
    """A worker's end of the weight push: receives every push as soon as the trainer sends it (while the engine
    generates); `take(push)` hands one push's tensors to the main thread when its "apply" command comes up."""

    def __init__(self, store, group, stopping: threading.Event):
        super().__init__(daemon=True)
        self.store, self.group, self.stopping = store, group, stopping
        self.received: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.ready = threading.Condition()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            push = 0
            while True:
                tensors, bucket = [], 0
                while True:
                    key = f"push/{push}/{bucket}"
                    while not (self.store.check([key]) or self.store.check([f"push/{push}/done"])):
                        if self.stopping.wait(POLL_S):
                            return  # the worker stops: no push is in flight after the trainer's stop command
                    if not self.store.check([key]):
                        break  # the push is complete
                    header: BucketHeader = pickle.loads(self.store.get(key))
                    flat = torch.empty(header.numel, dtype=torch.uint8)
                    broadcast(self.group, flat)
                    tensors += unpack_bucket(header.entries, flat)
                    bucket += 1
                with self.ready:
                    self.received[push] = tensors
                    self.ready.notify_all()
                push += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            with self.ready:
                self.failure = e
                self.ready.notify_all()

    def take(self, push: int) -> list[tuple[str, torch.Tensor]]:
        with self.ready:
            while push not in self.received and self.failure is None:
                self.ready.wait(1.0)
            if push not in self.received:
                raise RuntimeError(f"receiving weight push {push} failed: {self.failure}")
            return self.received.pop(push)
