"""The `strategy` section: devices, nodes, precision, the Lightning strategy and context parallelism
(`validate_context_parallel`: what is not built yet, refused before any model loads)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_ppo.config_fields import above, at_least
from lit_ppo.errors import ConfigError


@dataclass(frozen=True)
class StrategyConfig:
    """The `strategy` group: devices, nodes, precision and the Lightning strategy."""

    name: str = "single"
    accelerator: str = "auto"
    devices: int = field(default=1, metadata=at_least(1))
    num_nodes: int = field(default=1, metadata=at_least(1))
    precision: str = "auto"
    """bf16-mixed where the device computes bf16 natively, else 32-true (lit_ppo/precision.py)."""
    device_memory_gib: float | None = field(default=None, metadata=above(0))
    """Memory of one device for the plan's warning; null: detected where a GPU is present."""
    lightning: dict | None = None
    """The Lightning strategy (`_target_` and its arguments), built by Hydra; null: Lightning's choice."""
    context_parallel_size: int = field(default=1, metadata=at_least(1))
    """C: ranks that share their samples and split each row's tokens (Ulysses: lit_ppo/training/context_parallel.py);
    the data-parallel size is then devices x num_nodes / C. C > 1 trains under strategy=ddp and strategy=fsdp, full
    fine-tuning or LoRA, with gradient checkpointing, in every layout; the combinations not built yet are refused
    (`validate_context_parallel`)."""

    def __post_init__(self) -> None:
        ranks = self.devices * self.num_nodes
        if ranks % self.context_parallel_size:
            raise ConfigError(
                f"strategy.context_parallel_size={self.context_parallel_size} does not divide the {ranks} ranks "
                f"(strategy.devices x strategy.num_nodes); fix: a context_parallel_size that divides {ranks}"
            )

    @property
    def data_parallel_size(self) -> int:
        return self.devices * self.num_nodes // self.context_parallel_size


def validate_context_parallel(strategy: StrategyConfig, *, disaggregated: bool, tensor_parallel_size: int = 1) -> None:
    """strategy.context_parallel_size > 1, one line for each combination not built yet (strategy=ddp or fsdp, whose
    shards span every rank, with colocated rollouts trains: full fine-tuning or LoRA, gradient checkpointing or not,
    padded, packed or shared-prefix rows; lit_ppo/training/context_parallel.py)."""
    C = strategy.context_parallel_size
    if C == 1:
        return
    setting = f"strategy.context_parallel_size={C}"
    if strategy.name not in ("ddp", "fsdp"):
        raise ConfigError(
            f"{setting} with strategy={strategy.name} is not built; fix: strategy=ddp or strategy=fsdp, or "
            "context_parallel_size=1"
        )
    if disaggregated:
        raise ConfigError(
            f"{setting} with rollout.mode=disaggregated is not built yet; fix: rollout.mode=colocated, or "
            "context_parallel_size=1"
        )
    if tensor_parallel_size > 1:  # a tensor-parallel engine's generate is a collective of its ranks
        raise ConfigError(
            f"{setting} with rollout.tensor_parallel_size={tensor_parallel_size} is not built: a context-parallel "
            "group's rank 0 generates alone, and a tensor-parallel engine's generate needs all of its ranks; fix: "
            "rollout.tensor_parallel_size=1, or context_parallel_size=1"
        )


INNER_IMPLEMENTATIONS = ("sdpa", "eager")
"""The attention kernels context parallelism wraps (lit_ppo/training/context_parallel.py): they take the whole row's
4-D mask as given."""


def check_context_parallel_model(model_config, size: int, implementation: str | None) -> None:
    """What the exchange needs of a model (its config: transformers' or config.json's keys), one line otherwise: heads
    and KV heads divisible by C (ring attention, which would not need it, is not built), no sliding window, sdpa or
    eager kernels (`implementation`; null: transformers' default, sdpa). The pre-flight's check, before any model
    loads, and the training forward's."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise ConfigError(
            f"strategy.context_parallel_size={size}: the model's {heads} attention heads and {kv_heads} KV heads must "
            f"both divide by it (Ulysses; ring attention is not built); fix: a context_parallel_size dividing both"
        )
    windows = "sliding_attention" in (getattr(model_config, "layer_types", None) or ())
    if windows or (getattr(model_config, "sliding_window", None) and getattr(model_config, "use_sliding_window", True)):
        raise ConfigError(
            f"strategy.context_parallel_size={size}: the {model_config.model_type} model has sliding-window attention, "
            "which context parallelism does not handle yet; fix: strategy.context_parallel_size=1"
        )
    if (implementation or "sdpa") not in INNER_IMPLEMENTATIONS:
        raise ConfigError(
            f"strategy.context_parallel_size={size}: model.attn_implementation={implementation} is not built for "
            "context parallelism; fix: model.attn_implementation=sdpa (or eager)"
        )
