"""A vLLM general plugin for `bench/vllm_serve_probe.py`: registers a gloo weight-transfer engine (`lit_ppo_gloo`) with
`WeightTransferEngineFactory`, so that `vllm serve --weight-transfer-config '{"backend": "lit_ppo_gloo"}'` can take
full-weight pushes on CPU (vLLM's own engines, `nccl` and `ipc`, need CUDA).

vLLM calls `register` in each of its processes (API server, engine core, workers) through the entry point group
`vllm.general_plugins`; the probe declares that entry point in a `*.dist-info` directory it puts on the server's
PYTHONPATH, so nothing is installed. The engine side only: the probe itself plays the trainer (a TCPStore it hosts,
rank 0 of a two-rank gloo group, one broadcast per tensor)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

BACKEND = "lit_ppo_gloo"


def register() -> None:
    """The entry point: idempotent (vLLM may load plugins more than once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")


def gloo_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, is_master: bool):
    """Both sides' group: a TCPStore (hosted by rank 0) and a gloo process group of its own over it."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout, wait_for_workers=False)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return store, dist.ProcessGroupGloo(dist.PrefixStore("weights/", store), rank, world_size, options)


def broadcast(group, tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


try:  # the engine classes need vLLM; the probe's trainer side imports only the helpers above
    import torch
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # pragma: no cover
    WeightTransferEngine = None

if WeightTransferEngine is not None:

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        host: str
        port: int
        rank: int = 1
        world_size: int = 2
        timeout_s: float = 120.0

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        """Receives each tensor by a gloo broadcast from rank 0 and loads it through vLLM's layerwise reload (as
        vLLM's NCCL engine does: the model's own `load_weights`, Hugging Face names)."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.store = self.group = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            self.store, self.group = gloo_group(
                init_info.host, init_info.port, init_info.rank, init_info.world_size, init_info.timeout_s, False
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("lit_ppo_gloo: receive before /init_weight_transfer_engine")
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
                broadcast(self.group, tensor)
                self.model.load_weights([(name, tensor)])

        def shutdown(self) -> None:
            self.store = self.group = None
