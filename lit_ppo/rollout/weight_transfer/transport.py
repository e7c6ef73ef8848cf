"""The channel between the trainer and its rollout workers (docs/async.md), used from both sides.

- A TCPStore that the trainer hosts carries the small things: each worker's start signal, its ordered commands
  (`cmd/<worker>/<n>`: generate a request, apply a received weight version, stop) and its answers (`result/...`,
  pickled generations), all as the frozen dataclasses of `messages`. A store and not a multiprocessing queue: it works
  the same when a worker runs on another node (it connects to `host:port`), and every wait on it can be bounded and
  interleaved with a liveness check.
- A torch.distributed process group of its own (gloo; built from the store, never the default group, which vLLM
  and Lightning use) carries the weights, through vLLM's weight-transfer interface (`backend`: the trainer
  broadcasts each version in flat byte buckets, a thread in each worker receives them while its engine generates,
  and the worker loads a version when its ordered commands reach it). The receiving end is here, free of vLLM
  (`StagedReceiver`, with the bucket announcements it reads, `BucketInfo`): the HF engine's workers use it without
  vLLM, and vLLM's engine side (`backend.GlooWeightTransferEngine`) holds one.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from lit_ppo.errors import RolloutWorkerError, first_line

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


def host_store(host: str, port: int, timeout_s: float):
    """The trainer's store (it listens on every interface and connects to itself at `host`, the address the workers
    are told; `port` 0: any free one), or RolloutWorkerError in one line naming what to change: a taken
    rollout.workers.port, or a `host` that is not this node's."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=seconds_delta(timeout_s))
    except RuntimeError as e:
        reason = first_line(e, type(e).__name__)[:200]
        if "address already in use" in reason.lower():
            where = f"port {port}" if port else "a free port"
            fix = "set rollout.workers.port to a free port on this node" if port else "free a TCP port on this node"
        else:  # the store reaches itself at `host`: an address of another node never answers
            where, fix = (
                f"{host}:{port or '(any free port)'}",
                ("set rollout.workers.trainer_host (or LIT_PPO_ROLLOUT_HOST) to this node's name or address"),
            )
        raise RolloutWorkerError(
            f"trainer: cannot host the rollout workers' store on {where} ({reason}); fix: {fix}"
        ) from None


def take_key(store, key: str) -> bytes:
    """A worker's wait for its next command: the value of `key` once set, then deleted (the trainer's waits are
    bounded and watch liveness instead: `RolloutWorkers`)."""
    while not store.check([key]):
        time.sleep(POLL_S)
    value = store.get(key)
    store.delete_key(key)
    return value


@dataclass
class BucketInfo:
    """One bucket of a weight push as the trainer announces it (`backend.GlooUpdateInfo` is this, as vLLM's
    update info): push number, bucket number, each tensor's name, dtype and shape, the bucket's size in bytes and the
    policy version the push carries."""

    push: int
    bucket: int
    entries: list
    nbytes: int
    weight_version: str | None = None

    def __post_init__(self):  # one form whichever way it came (pickled tuples, or JSON lists from an HTTP client)
        self.entries = [[name, dtype, list(shape)] for name, dtype, shape in self.entries]


def bucket_fields(info) -> tuple:
    return info.push, info.bucket, info.entries, info.nbytes, info.weight_version


def update_info_key(push: int, bucket: int) -> str:
    """The store key under which the trainer announces a bucket before broadcasting it (the receivers wait on it)."""
    return f"push/{push}/{bucket}"


def push_done_key(push: int) -> str:
    return f"push/{push}/done"


class PushAnnouncer:
    """The trainer's announcements of each push's buckets and end in its store, where the receivers
    (`StagedReceiver`, spawned workers' and servers' alike) wait for them: pushes numbered 0, 1, ... in order. A
    bucket of another push than the one due, or a push of no bucket, is refused: the receivers would wait on for it."""

    def __init__(self, store):
        self.store = store
        self.push = 0  # the push due
        self.buckets = 0  # announced of it so far

    def bucket(self, update_info: dict) -> None:
        """A bucket's info (its `update_weights` info), before its broadcast."""
        if update_info["push"] != self.push:
            raise RuntimeError(f"weight push {update_info['push']} announced where push {self.push} was due")
        self.store.set(update_info_key(update_info["push"], update_info["bucket"]), pickle.dumps(update_info))
        self.buckets += 1

    def end(self) -> None:
        """The push has no more buckets (the receivers then wait for the next push)."""
        if not self.buckets:
            raise ValueError(f"weight push {self.push} of no tensors")
        self.store.set(push_done_key(self.push), b"1")
        self.push, self.buckets = self.push + 1, 0


def probe_mismatch(
    probe: tuple[list[int], list[int], list[float]] | None,
    max_logprob_abs_diff: float | None,
    sequence_logprobs: Callable[[list[int], list[int]], list[float]],
    where: str,
) -> str | None:
    """The one line to raise where weights just applied are not the trainer's of that version, else None:
    `sequence_logprobs(prompt, response)`, the engine's log-probs of the probe's response (a worker's engine, or a
    server's teacher-forced `prompt_logprobs`), against the trainer's (`probe`: prompt, response, expected), their mean
    absolute difference per token within rollout.max_logprob_abs_diff, as colocated runs bound it (`where` names the
    side and the version). An engine that returns another number of log-probs than the response's tokens fails too."""
    if probe is None or max_logprob_abs_diff is None:
        return None
    prompt, response, expected = probe
    got = list(sequence_logprobs(prompt, response))
    if len(got) != len(expected) or not expected:
        return (
            f"{where} it returned {len(got)} log-probs for a probe response of {len(expected)} tokens: the engine "
            "does not score the sequence the trainer sent"
        )
    diff = sum(abs(a - b) for a, b in zip(got, expected, strict=True)) / len(expected)
    if diff <= max_logprob_abs_diff:  # NaN is not
        return None
    return (
        f"{where} its log-probs of a probe sequence differ from the trainer's by {diff:.3f} nats per token (more "
        f"than rollout.max_logprob_abs_diff={max_logprob_abs_diff}): the pushed weights did not arrive intact"
    )


def unpack_bucket(entries: list, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one bucket received as bytes (views into `flat`)."""
    tensors, offset = [], 0
    for name, dtype, shape in entries:
        dtype = getattr(torch, dtype)
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        tensors.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
        offset += nbytes
    return tensors


class StagedReceiver(threading.Thread):
    """A worker's end of the push: joins the gloo group, then receives every bucket as soon as the trainer announces
    and broadcasts it (while the worker's engine generates), keeping it until `take` (the worker's
    apply of that version) asks for it."""

    def __init__(self, store, group, stopping: threading.Event | None = None):
        super().__init__(daemon=True, name="lit-ppo-weight-receiver")
        self.store, self.group = store, group
        self.stopping = stopping if stopping is not None else threading.Event()
        self.received: dict[tuple[int, int], tuple[BucketInfo, list[tuple[str, torch.Tensor]]]] = {}
        self.ready = threading.Condition()
        self.failure: BaseException | None = None

    @classmethod
    def joining(cls, info, rank_within_engine: int = 0) -> "StagedReceiver":
        """A receiver in the trainer's group: a client of its store, this process's end of the gloo group (the
        rendezvous completes when the trainer and every worker joined); `rank_within_engine`: the engine process's
        rank among its engine's (tensor-parallel) processes; `info`: a `backend.GlooInitInfo`."""
        import torch.distributed as dist

        store = dist.TCPStore(info.host, info.port, is_master=False, timeout=seconds_delta(info.timeout_s))
        rank = info.rank_offset + rank_within_engine
        return cls(store, gloo_group(store, rank, info.world_size, info.timeout_s, info.own_host or info.host))

    def run(self) -> None:
        try:
            push = 0
            while True:
                bucket = 0
                while True:
                    key = update_info_key(push, bucket)
                    while not (self.store.check([key]) or self.store.check([push_done_key(push)])):
                        if self.stopping.wait(POLL_S):
                            with self.ready:  # the worker stops: nothing more is taken
                                self.failure = RuntimeError("the receiver was stopped")
                                self.ready.notify_all()
                            return
                    if not self.store.check([key]):
                        break  # the push is complete
                    info = BucketInfo(**pickle.loads(self.store.get(key)))
                    flat = torch.empty(info.nbytes, dtype=torch.uint8)
                    broadcast(self.group, flat)
                    with self.ready:
                        self.received[(push, bucket)] = (info, unpack_bucket(info.entries, flat))
                        self.ready.notify_all()
                    bucket += 1
                push += 1
        except BaseException as e:  # noqa: BLE001 - reported by the thread that takes
            with self.ready:
                self.failure = e
                self.ready.notify_all()

    def take(self, expected: BucketInfo) -> list[tuple[str, torch.Tensor]]:
        """The bucket `expected` names, once received; it must be the one announced (same tensors, same policy
        version): the worker's "apply" command and the broadcast came by different ways."""
        key = (expected.push, expected.bucket)
        with self.ready:
            while key not in self.received and self.failure is None:
                self.ready.wait(1.0)
            if key not in self.received:
                raise RuntimeError(f"receiving weight push {key[0]} (bucket {key[1]}) failed: {self.failure}")
            got, tensors = self.received.pop(key)
        if bucket_fields(got) != bucket_fields(expected):
            differs = next(
                f for f in ("weight_version", "nbytes", "entries") if getattr(got, f) != getattr(expected, f)
            )
            raise RuntimeError(
                f"weight push {key[0]} bucket {key[1]}: the received bucket's {differs} differs from the apply "
                f"command's (received version {got.weight_version}, {len(got.entries)} tensors, {got.nbytes} bytes; "
                f"named version {expected.weight_version}, {len(expected.entries)} tensors, {expected.nbytes} bytes); "
                "the worker would load other weights than planned"
            )
        return tensors

    def take_all(self, update_infos: list[dict]) -> list[tuple[str, torch.Tensor]]:
        """Every bucket of a push, in order (its `update_weights` infos)."""
        return [t for info in update_infos for t in self.take(BucketInfo(**info))]

    def stop(self) -> None:
        """Stop receiving and join (a thread inside gloo's C++ at interpreter teardown aborts the process)."""
        self.stopping.set()
        if self.is_alive():
            self.join()
        self.group = None
