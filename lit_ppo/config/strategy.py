"""The `strategy` section: devices, nodes, precision and the Lightning strategy."""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_ppo.config_fields import above, at_least


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

    @property
    def data_parallel_size(self) -> int:
        return self.devices * self.num_nodes
