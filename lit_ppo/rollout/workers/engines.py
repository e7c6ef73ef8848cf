"""The engine a rollout worker runs, by `rollout.engine`: one table keyed by the engine's name, with what the trainer
sends each worker (`settings`, plain values in the WorkerSpec) and how the worker starts the engine from them
(`start`). A new engine for the workers is a new row here; nothing else asks which engine a worker holds.

Every engine here does, beside the contract's `generate`: the worker's end of the weight transfer
(`lit_ppo/rollout/weight_transfer/`: `open_weight_transfer(init_info)`, `apply_weight_transfer(update_infos, version)`,
`apply_adapter_transfer(update_infos, peft_config, version)` with model.lora, `close_weight_transfer()`,
`weight_version`, `set_weight_version`), `sequence_logprobs` (the probe check after each applied version) and
`adapter_version` (recorded on every sample).

- `vllm`: `VLLMEngine`, the run's vLLM settings; pushes load through vLLM's own weight-transfer API.
- `hf`: `HFEngine.from_model_dir`: the worker loads `model_dir` itself (a copy of the actor, in the trainer's
  precision) and generates with Hugging Face `generate`, seeded per sample as in colocated runs; pushed weights are
  received by the same receiver as vLLM's (`StagedReceiver`) and copied into it, a pushed adapter wraps it in peft
  once and is loaded into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def vllm_settings(datamodule, plan) -> dict:
    """`VLLMEngine`'s keywords from the run's rollout settings."""
    r = datamodule.rollout
    return dict(
        model_dir=datamodule.model_dir,
        dtype=r.dtype or plan.models.rollout_dtype,
        max_model_len=r.max_model_len,
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_gib=r.kv_cache_gib,
        seed=datamodule.seed,
        tensor_parallel_size=r.tensor_parallel_size,
        enforce_eager=r.enforce_eager,
        max_lora_rank=plan.lora.vllm_max_lora_rank if plan.lora else None,  # model.lora: the base, then adapters pushed
        weight_transfer=True,  # pushes through vLLM's weight-transfer interface (rollout/weight_transfer/backend.py)
    )


def start_vllm(settings: dict):
    from lit_ppo.rollout.engine import VLLMEngine

    return VLLMEngine(**settings)


def hf_settings(datamodule, plan) -> dict:
    """`HFEngine.from_model_dir`'s keywords: the model as the trainer loads its actor (precision, attention, a LoRA
    base's dtype), the run's seed and rollout.hf_max_batch_sequences."""
    return dict(
        model_dir=datamodule.model_dir,
        precision=plan.models.precision,
        seed=datamodule.seed,
        max_batch_sequences=datamodule.rollout.hf_max_batch_sequences,
        lora=plan.lora is not None,
        attn_implementation=datamodule.attn_implementation,
    )


def start_hf(settings: dict):
    from lit_ppo.rollout.hf_engine import HFEngine

    return HFEngine.from_model_dir(**settings)


@dataclass(frozen=True)
class WorkerEngine:
    settings: Callable  # (datamodule, plan) -> dict: what the trainer sends (WorkerSpec.engine)
    start: Callable[[dict], object]  # the worker's: settings -> the engine


WORKER_ENGINES = {
    "vllm": WorkerEngine(vllm_settings, start_vllm),
    "hf": WorkerEngine(hf_settings, start_hf),
}
"""rollout.engine -> how a rollout worker runs it (config/rollout.py:ROLLOUT_ENGINES names the same; tests/rollout/test_async.py checks
that every one has a row)."""


def worker_engine_settings(name: str, datamodule, plan) -> dict:
    return WORKER_ENGINES[name].settings(datamodule, plan)


def start_worker_engine(name: str, settings: dict):
    return WORKER_ENGINES[name].start(settings)
