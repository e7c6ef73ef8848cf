"""Data and context parallelism: reductions over ranks or a group of them (on one process they return their input),
the all-to-all exchange of a context-parallel group, FSDP2 sharding and gathering a sharded model's full tensors (or
only some of them: a LoRA adapter).

The reductions of samples (sums, maxima and gathers of what ranks hold) run over the data-parallel group unless told
otherwise: with context parallelism (C > 1) the C ranks of a context-parallel group hold the same samples, and a sum
over every rank would count each C times. `use_data_parallel_group` sets that group once the topology's groups are
built (`RankTopology.with_groups`); with C = 1 it is torch's default group, every rank. What must reach every rank
(a preemption signal, the checkpoint's per-rank states) passes `group=EVERY_RANK`."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

EVERY_RANK = "every rank"
"""The `group` of a collective that must reach every rank, whatever the data-parallel group."""

_data_parallel_group = None  # None: torch's default group (C = 1); set by `use_data_parallel_group`


def use_data_parallel_group(group) -> None:
    """The group the reductions of samples run over from now on (`RankTopology.with_groups`'s data-parallel group)."""
    global _data_parallel_group
    _data_parallel_group = group


def _group(group):
    """A collective's process group: None is the data-parallel group, EVERY_RANK torch's default group."""
    if group is None:
        return _data_parallel_group
    return None if group == EVERY_RANK else group


def world_size(group=None) -> int:
    """The ranks of `group` (None: the data-parallel group, every rank with C = 1; EVERY_RANK: every rank); 1 without
    a process group."""
    return dist.get_world_size(_group(group)) if dist.is_available() and dist.is_initialized() else 1


def global_sum(x: Tensor, group=None) -> Tensor:
    """Sum over data-parallel ranks, or over `group`'s (`RankTopology`'s groups); identity on one process."""
    if world_size(group) > 1:
        x = x.clone()
        dist.all_reduce(x, group=_group(group))
    return x


def global_max(x: Tensor, group=None) -> Tensor:
    """Element-wise maximum over data-parallel ranks, or over `group`'s (identity on one process)."""
    if world_size(group) > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_group(group))
    return x


def all_to_all(x: Tensor, group, split_dim: int, gather_dim: int) -> Tensor:
    """`x` cut into equal chunks along `split_dim`, one per rank of `group`, chunk j sent to the group's rank j; the
    chunks received (one from each rank, in rank order) joined along `gather_dim` (a collective over `group`). gloo
    (CPU) and NCCL both have all_to_all."""
    parts = [part.contiguous() for part in x.chunk(world_size(group), dim=split_dim)]
    received = [torch.empty_like(part) for part in parts]
    dist.all_to_all(received, parts, group=group)
    return torch.cat(received, dim=gather_dim)


def all_gather_objects(obj, group=None) -> list:
    """Every data-parallel rank's `obj` (picklable), or every rank's of `group`, in rank order (a collective: every
    rank calls it); [obj] on one process."""
    if world_size(group) == 1:
        return [obj]
    gathered: list = [None] * world_size(group)
    dist.all_gather_object(gathered, obj, group=_group(group))
    return gathered


def all_gather_padded(x: Tensor) -> list[Tensor]:
    """Every rank's `x` in rank order (a collective: every rank calls it), each with its own number of rows (dim 0) and
    its trailing sizes padded with zeros to the largest rank's: ranks' [N_r, T_r] experiences become [N_r, max T_r].
    [x] on one process."""
    if world_size() == 1:
        return [x]
    shapes = all_gather_objects(tuple(x.shape))
    largest = [max(sizes) for sizes in zip(*shapes)]
    padded = x.new_zeros(largest)
    padded[tuple(slice(0, n) for n in x.shape)] = x
    parts = [torch.empty_like(padded) for _ in shapes]
    dist.all_gather(parts, padded, group=_group(None))
    return [part[: shape[0]] for part, shape in zip(parts, shapes)]


def shard_models(models, mesh, bf16_mixed: bool = False) -> None:
    """FSDP2: `fully_shard` each decoder layer, then the rest, of every model (None entries are skipped).

    A layer is its own FSDP unit so that only one layer's parameters are gathered at a time. A peft (LoRA) model is
    sharded the same way, its frozen base and its adapter in the same units: FSDP2 reduces only the gradients that
    exist (the adapter's, and the critic's value head) and needs one dtype among the trainable parameters of a unit,
    which they have (float32, `models.with_lora`); the frozen base may be bf16 beside them (bf16-mixed), as the
    policy gathers everything in bf16 anyway."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # bf16-mixed: float32 parameters, gradients and AdamW states (the shards), bf16 for the gathered
    # parameters that compute, gradients reduced in float32 (as verl and OpenRLHF train under FSDP).
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16_mixed
        else MixedPrecisionPolicy()
    )
    for model in models:
        if model is None:
            continue
        layer_classes = set(model._no_split_modules or ())  # Hugging Face's name for its decoder layer class
        for layer in [m for m in model.modules() if type(m).__name__ in layer_classes]:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)


def gathered(tensor: Tensor) -> Tensor:
    """The tensor whole: an FSDP2 shard (a DTensor) gathered from every rank, which is a collective (every rank calls
    it, in the same order); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The model's tensors by Hugging Face name, sharded ones gathered one at a time.

    Gathering is a collective under FSDP: every rank must iterate, in the same order. A parameter
    listed under two names (tied embeddings) is gathered once and given under both, as one tensor,
    so that `save_pretrained` still sees the tie."""
    state = model.state_dict()
    # state_dict() gives each name its own tensor object; the parameters tell which names are one.
    parameter = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    key = {name: parameter.get(name, id(tensor)) for name, tensor in state.items()}
    listed = Counter(key.values())
    gathered: dict[int, Tensor] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, DTensor):
            yield name, tensor
        elif listed[key[name]] == 1:
            yield name, tensor.full_tensor()
        else:
            if key[name] not in gathered:
                gathered[key[name]] = tensor.full_tensor()
            yield name, gathered[key[name]]


def full_tensor_metadata(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """What `full_tensors` will yield, in its order: each name, dtype and whole (global) shape, read without gathering
    anything (a sharded tensor knows its global shape)."""
    return [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]


@contextmanager
def gradient_sync(enabled: bool, wrapper, models, sharded: bool):
    """Backward passes with the gradient all-reduce (DDP) or reduce-scatter (FSDP2) only when `enabled`: the last
    micro-batch of an optimizer step. Before it, DDP's `no_sync` / FSDP2's `set_requires_gradient_sync(False)` let
    the gradients accumulate on each rank, and the synced backward reduces their sum: the same gradients as a sync
    per micro-batch (sums commute with the averaging), for 1/accumulation of the communication."""
    if enabled:
        yield
    elif isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
        with wrapper.no_sync():
            yield
    elif sharded:
        for model in models:
            model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for model in models:
                model.set_requires_gradient_sync(True)
    else:
        yield


def broadcast_object(obj, device: torch.device, src: int = 0, group=EVERY_RANK):
    """Rank `src`'s `obj` (picklable) on every rank of `group` (EVERY_RANK: every rank, `src` the global rank; else a
    process group, `src` the rank within it); a collective: every rank of `group` calls it, the others' `obj` is
    ignored. `obj` itself on one process. `device`: where the process group's tensors live (NCCL: the rank's GPU)."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    if group == EVERY_RANK:
        dist.broadcast_object_list(box, src=src, device=device)
    else:
        dist.broadcast_object_list(box, group=_group(group), group_src=src, device=device)
    return box[0]
