"""The `trainer` section (the run's length, evaluations, checkpoints, the collectives' timeout) and the `logger`
section."""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_ppo.config_fields import at_least
from lit_ppo.errors import ConfigError


@dataclass(frozen=True)
class TrainerConfig:
    """The `trainer` section: how long the run is (exactly one of the two lengths is set) and what it does on the way."""

    total_rollout_steps: int | None = 30
    """Run length in rollout steps ..."""
    data_epochs: float | None = None
    """... or in passes over the prompts."""
    eval_every: int = field(default=10, metadata=at_least(0))
    """Rollout steps between evaluations (also at the start and the end); 0: none during the run."""
    checkpoint_every: int = field(default=10, metadata=at_least(0))
    """Rollout steps between checkpoints (also at the end); 0: only at the end."""
    keep_checkpoints: int = field(default=2, metadata=at_least(1))
    """The last K checkpoints are kept."""
    max_consecutive_skipped_updates: int = field(default=3, metadata=at_least(1))
    """Non-finite loss or gradient: the update is skipped; the run stops after this many in a row."""
    collective_timeout_s: float = 1800.0
    """Seconds a rank waits for the others in one collective (an all-reduce, the weight sync's gathers, a checkpoint's
    barrier, the process group's start) before the run stops naming the phase it waited in (lit_ppo/waits.py); the
    torch.distributed process group's timeout. Lightning's default; raise it when ranks legitimately drift further
    apart (long evaluations, very uneven generation)."""

    def __post_init__(self) -> None:
        if not isinstance(self.collective_timeout_s, (int, float)) or self.collective_timeout_s <= 0:
            raise ConfigError(
                f"trainer.collective_timeout_s={self.collective_timeout_s!r}; fix: a positive number of seconds"
            )


@dataclass(frozen=True)
class LoggerConfig:
    """The `logger` group: metrics.csv is always written; `extra` is a further Lightning logger (W&B, TensorBoard)."""

    name: str = "csv"
    extra: dict | None = None
