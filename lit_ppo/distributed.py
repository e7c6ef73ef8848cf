"""Reductions over data-parallel ranks; on one process they return their input."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_sum(x: Tensor) -> Tensor:
    """Sum over data-parallel ranks (identity on one process)."""
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def global_max(x: Tensor) -> Tensor:
    """Element-wise maximum over data-parallel ranks (identity on one process)."""
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x
