"""The weight push from the trainer to its rollout workers, written against vLLM's weight-transfer interface
(`vllm.distributed.weight_transfer`, docs/async.md): a backend of lit-ppo's own, `lit_ppo_gloo`, registered with
vLLM's factories on both sides.

- Trainer side: `GlooTrainerWeightTransferEngine` (a `TrainerWeightTransferEngine`) streams a `TensorSource` (a
  `WeightSource`: one policy version's tensors, declared by `metadata()` before any is read, each checked against
  it as it is read) in flat byte buckets of at most rollout.workers.weight_push_bucket_mib, broadcast over a gloo
  group of the trainer and its workers, and drives the workers' side through a `VLLMWeightSyncClient`
  (`RolloutWorkers`): `start_weight_update`, one `update_weights` per bucket (its `GlooUpdateInfo`), then
  `finish_weight_update(version)`.
- Engine side: `GlooWeightTransferEngine` (a `WeightTransferEngine`), which vLLM builds in each worker's engine from
  `weight_transfer_config={"backend": "lit_ppo_gloo"}`. Its `init_transfer_engine` joins the gloo group and starts a
  `StagedReceiver`; `receive_weights` loads one received bucket into the model by vLLM's `load_weights`, inside
  vLLM's layerwise reload (`start_weight_update` / `finish_weight_update`), as vLLM's NCCL engine loads.

Why the receive is staged: rollout workers generate ahead (k steps) on an exact schedule, so a worker must take
version v's bytes while it still generates with v - 1, and load them only when its ordered commands reach "apply
v". vLLM's own engines receive and load in the one `update_weights` call (their trainer waits for it), which would
stall the trainer until the worker's queue came round. So the receiver thread takes each bucket as it is broadcast;
the worker's client calls (`update_weights` with the bucket's info) come later, through vLLM's offline RL API
(`LLM.start_weight_update` / `update_weights` / `finish_weight_update`), and load what was received. The same
receiver serves `rollout.engine=hf` workers, which have no vLLM (`HFEngine.open_weight_transfer`). A vLLM server
(rollout.workers.launch=server) builds the same engine side, registered by lit-ppo's vLLM general plugin (`register`,
pyproject.toml's entry point); its client (`server_push.ServerSyncClient`) sends each bucket's /update_weights while the
bucket is broadcast, and the server loads it as soon as its receiver has it (a server has no ordered queue).

With model.lora the pushed tensors are the adapter: they travel the same way, and the worker loads them as an adapter
version (`VLLMEngine.sync_adapter`), since vLLM's transfer engines load base weights only.

Without vLLM (rollout.engine=hf workers on a machine that lacks it) the interface's base classes and factories are
interface.py's, with the same names and calls; the push is the same code.
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar, Iterable, Iterator

import torch

if importlib.util.find_spec("vllm") is not None:  # vLLM's own interface (an import error in it is raised as is)
    from vllm.distributed.weight_transfer.base import (
        ParamMeta,
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightSource,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
else:  # no vLLM (rollout.engine=hf workers): the interface's names as interface.py writes them
    from lit_ppo.rollout.weight_transfer.interface import (
        ParamMeta,
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightSource,
        WeightTransferEngine,
        WeightTransferEngineFactory,
        WeightTransferInitInfo,
        WeightTransferTrainerFactory,
        WeightTransferUpdateInfo,
    )

from lit_ppo.errors import WeightSyncError
from lit_ppo.rollout.weight_transfer.transport import (
    POLL_S,
    BucketInfo,
    StagedReceiver,
    broadcast,
    gloo_group,
    seconds_delta,
)

BACKEND = "lit_ppo_gloo"
"""The backend's name in vLLM's factories (`weight_transfer_config={"backend": BACKEND}`)."""


# ------------------------------------------------------------ what crosses the interface


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: the store the workers connect to (`host:port`), the group's size (the trainer and every
    worker), the largest bucket and how long one bucket's broadcast may take."""

    backend: ClassVar[str] = BACKEND

    host: str
    port: int
    world_size: int
    bucket_bytes: int
    timeout_s: float


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """A worker's side (`init_weight_transfer_engine`'s info): the trainer's store, the group's size and timeout, the
    first group rank of this worker's engine (1 + its number x its engine's processes: each tensor-parallel rank of a
    vLLM engine receives whole tensors and loads its part, as vLLM's NCCL engine does) and the address its end binds
    to."""

    host: str
    port: int
    world_size: int
    timeout_s: float
    rank_offset: int = -1
    own_host: str = ""


@dataclass
class GlooUpdateInfo(BucketInfo, WeightTransferUpdateInfo):
    """One bucket (`update_weights`' info; `transport.BucketInfo`'s fields): push number, bucket number, each tensor's
    name, dtype and shape, the bucket's size in bytes and the policy version the push carries."""


# ------------------------------------------------------------ trainer side


class TensorSource(WeightSource):
    """One policy version's tensors for the trainer engine: `metadata()` declares every (name, dtype, shape) without
    reading a tensor; iteration yields them (a sharded actor gathers each as it is read: a collective, so every trainer
    rank iterates) and stops the push in one line where a tensor differs from what was declared. One pass: each
    version is a new source."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]], metadata: list[ParamMeta]):
        self._tensors, self._metadata, self._read = tensors, metadata, False
        self.bytes = 0

    @classmethod
    def of_dict(cls, tensors: dict[str, torch.Tensor]) -> "TensorSource":
        return cls(tensors.items(), [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])

    def metadata(self) -> list[ParamMeta]:
        return self._metadata

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._read:
            raise RuntimeError("TensorSource: one version's tensors are read once; make a new source per push")
        self._read = True
        declared = iter(self._metadata)
        for name, tensor in self._tensors:
            meta = next(declared, None)
            got = ParamMeta(name, tensor.dtype, tuple(tensor.shape))
            if meta != got:
                raise WeightSyncError(
                    f"trainer: the weight push read {_describe(got)} where its metadata declared "
                    f"{_describe(meta) if meta else 'no more tensors'}; the workers would load the wrong tensors; fix: "
                    "report it (the actor's state_dict changed between the declaration and the read)"
                )
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor
        missing = next(declared, None)
        if missing is not None:
            raise WeightSyncError(
                f"trainer: the weight push ended before {_describe(missing)}, which its metadata declared; the workers "
                "would keep stale tensors; fix: report it"
            )


def _describe(meta: ParamMeta) -> str:
    return f"{meta.name} ({str(meta.dtype).removeprefix('torch.')} {list(meta.shape)})"


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


class BucketBroadcastError(RuntimeError):
    """A bucket's broadcast failed (a worker died or stuck): the client turns it into its one line."""

    def __init__(self, bucket: int, nbytes: int, seconds: float, cause: BaseException):
        super().__init__(f"bucket {bucket} ({nbytes / 2**20:.1f} MiB) after {seconds:.1f} s: {type(cause).__name__}")
        self.bucket, self.nbytes, self.seconds, self.cause_name = bucket, nbytes, seconds, type(cause).__name__


def start_trainer_transfer(
    *, host: str, port: int, world_size: int, bucket_bytes: int, timeout_s: float, client
) -> "GlooTrainerWeightTransferEngine":
    """The trainer's end of `lit_ppo_gloo` (rank 0), as vLLM's factory builds it, for the workers' sync `client`
    (spawned workers' or servers'), its group's rendezvous on the trainer's store at `host:port`. The workers join
    through the client's `init_weight_transfer_engine`; the servers' client then waits for their answers
    (`ServerSyncClient.joined`)."""
    info = GlooTrainerInitInfo(
        host=host, port=port, world_size=world_size, bucket_bytes=bucket_bytes, timeout_s=timeout_s, rank=0
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=client)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's end of `lit_ppo_gloo`. Built by `WeightTransferTrainerFactory.trainer_init` (every trainer rank
    may build one; rank 0 sends, the others only read the source, which keeps an FSDP actor's gathers aligned).

    Each push is a new `TensorSource` (`send_weights(source)`; the factory's source, if any, otherwise), since a
    version's tensors are read once. `send_weights` returns when every bucket is broadcast: the workers have received
    it (their receivers take each bucket as sent) and load it when their queues reach it."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True, bucket_bytes: int = 2**26):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group = None
        self._store = None
        self.pushes = 0
        self.failed = False  # a push failed part way: the receivers wait for buckets that never come

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None) -> "GlooTrainerWeightTransferEngine":
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes)
        if not engine.is_sender:
            return engine
        import torch.distributed as dist

        # The workers join the group inside init_weight_transfer_engine (queued to them first); the group's
        # rendezvous completes once the trainer joins too.
        engine.client.init_weight_transfer_engine(
            asdict(GlooInitInfo(init_info.host, init_info.port, init_info.world_size, init_info.timeout_s))
        )
        engine._store = dist.TCPStore(
            init_info.host, init_info.port, is_master=False, timeout=seconds_delta(init_info.timeout_s)
        )
        # The rendezvous waits for every worker's engine: watched, so that a worker that fails before it joins is
        # named at once (the client's check_alive) rather than after the group's timeout.
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            joined = pool.submit(
                gloo_group, engine._store, 0, init_info.world_size, init_info.timeout_s, init_info.host
            )
            while not joined.done():
                check_alive = getattr(client, "check_alive", None)
                if check_alive is not None:
                    check_alive()
                time.sleep(POLL_S)
            engine.group = joined.result()
        finally:
            pool.shutdown(wait=False)  # after a failure the join ends with its own timeout; nobody waits for it
        return engine

    def send_weights(self, source: TensorSource | None = None, weight_version: str | None = None) -> None:
        """Broadcast `source` bucket by bucket, each announced (`client.update_weights`) before it is sent."""
        source = source if source is not None else self.source
        if source is None:
            raise ValueError("GlooTrainerWeightTransferEngine.send_weights: no WeightSource for this push")
        if not self.is_sender:
            for _ in source:  # the gathers the sender's read meets
                pass
            return
        if self.failed:
            raise RuntimeError(
                "lit_ppo_gloo: an earlier weight push failed part way, so the workers' receivers are out of step with "
                "the trainer; the run must stop (a resume starts a new group)"
            )
        push = self.pushes
        try:
            self.client.start_weight_update()
            for bucket, (entries, flat) in enumerate(weight_buckets(source, self.bucket_bytes)):
                info = GlooUpdateInfo(push, bucket, entries, flat.numel(), weight_version)
                self.client.update_weights(asdict(info))
                started = time.monotonic()
                try:
                    broadcast(self.group, flat)
                except RuntimeError as e:
                    raise BucketBroadcastError(bucket, flat.numel(), time.monotonic() - started, e) from None
            self.client.finish_weight_update(weight_version)
        except BaseException:
            self.failed = True
            raise
        self.pushes += 1

    def shutdown(self) -> None:
        self.group = self._store = None


# ------------------------------------------------------------ engine (worker) side


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The worker's end of `lit_ppo_gloo` inside vLLM (its worker builds it from the engine's
    weight_transfer_config): receives through a `StagedReceiver`, loads one bucket per `update_weights` through the
    model's `load_weights` inside vLLM's layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: StagedReceiver | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        # Each of the engine's processes (tensor-parallel ranks) receives whole tensors; load_weights takes its part.
        self.receiver = StagedReceiver.joining(init_info, self.parallel_config.rank)
        self.receiver.start()

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("lit_ppo_gloo: update_weights before init_weight_transfer_engine")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        tensors = self.receiver.take(update_info)
        with disable_mtp_completeness_check():  # a bucket is part of the model, as vLLM's NCCL engine loads it
            self.model.load_weights(tensors)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()
            self.receiver = None


def register() -> None:
    """`lit_ppo_gloo` in vLLM's factories, once per process: on import here, and through lit-ppo's vLLM plugin entry
    point (pyproject.toml, `vllm.general_plugins`), which vLLM loads in every process it starts (an engine core or
    tensor-parallel workers in processes of their own)."""
    for factory, engine in (
        (WeightTransferEngineFactory, GlooWeightTransferEngine),
        (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine),
    ):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, engine)
        elif factory._registry[BACKEND]() is not engine:
            raise RuntimeError(
                f"vLLM's {factory.__name__} has another engine registered as {BACKEND!r} "
                f"({factory._registry[BACKEND]().__module__}); fix: rename that backend"
            )


register()
