"""The `rollout.vllm` section: the settings of the vLLM engine alone (rollout.engine=vllm; lit_ppo/rollout/engine.py
reads them, and the memory estimate). The settings every engine shares (dtype, max_model_len, tensor_parallel_size,
...) stay in `rollout` (rollout.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_ppo.config_fields import above, within


@dataclass(frozen=True)
class VLLMConfig:
    """`rollout.vllm`: vLLM's own settings (a run with another rollout.engine names any it set in a plan note)."""

    gpu_memory_utilization: float = field(default=0.3, metadata=within(0, 1, low_open=True))
    """The share of the GPU vLLM reserves for its weights and KV cache (on CPU vLLM reserves RAM by it; keep it small)."""
    kv_cache_gib: float = field(default=1, metadata=above(0))
    """On CPU: vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = True
    """No CUDA graphs (vLLM's enforce_eager)."""
    sleep_between_steps: bool = True
    """Free vLLM's memory while training (GPU only)."""

    def memory_inputs(self) -> dict:
        """What the memory estimate reads of this section (`lit_ppo.memory.MemoryInputs`' keywords)."""
        return dict(
            gpu_memory_utilization=self.gpu_memory_utilization,
            vllm_sleeps=self.sleep_between_steps,
            cpu_kv_cache_gib=self.kv_cache_gib,
        )
