"""Loaded at interpreter start by the runs of tests/training/test_grad_sync.py (on PYTHONPATH): counts gradient
synchronisations. DDP: a communication hook on every DistributedDataParallel, one line per backward pass that
all-reduced gradients (its last bucket). FSDP2: one line per reduce-scatter of a parameter group."""

import os

if os.environ.get("LIT_PPO_COUNT_GRAD_SYNC"):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    def _record(kind: str) -> None:
        with open(os.path.join(os.environ["LIT_PPO_COUNT_GRAD_SYNC"], f"rank{dist.get_rank()}.txt"), "a") as f:
            f.write(kind + "\n")

    _ddp_init = DistributedDataParallel.__init__

    def _counting_init(self, *args, **kwargs):
        _ddp_init(self, *args, **kwargs)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            allreduce_hook,
        )

        def hook(state, bucket):
            if bucket.is_last():
                _record("ddp_allreduce_pass")
            return allreduce_hook(state, bucket)

        self.register_comm_hook(None, hook)

    DistributedDataParallel.__init__ = _counting_init

    for _name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, _name):

            def _counting(*args, _original=getattr(dist, _name), **kwargs):
                _record("reduce_scatter")
                return _original(*args, **kwargs)

            setattr(dist, _name, _counting)
