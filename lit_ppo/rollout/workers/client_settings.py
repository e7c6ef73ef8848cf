"""What a client of the rollout workers takes from the run, the same for every launch (`client.RolloutWorkers`: spawned
or external workers; `servers.ServerWorkers`: vLLM servers), built from the run's settings by `pools.client_settings`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClientSettings:
    workers: int
    """How many rollout workers (rollout.workers.count)."""
    devices_per_worker: int
    """Devices each worker (or server) runs on (rollout.workers.devices)."""
    trainer_devices: int
    """The trainer's devices on rank 0's node: spawned workers (and servers) take the devices after them."""
    log_dir: Path
    """Where spawned workers' and servers' logs go (`<run>/logs`)."""
    start_timeout_s: float
    """How long the workers' start may take (rollout.workers.start_timeout_s)."""
    batch_timeout_s: float
    """How long one request's results may take (rollout.workers.batch_timeout_s)."""
    push_timeout_s: float
    """How long a weight push may take (rollout.workers.weight_push_timeout_s)."""
    bucket_mib: int
    """The weight push's bucket (rollout.workers.weight_push_bucket_mib)."""
    max_logprob_abs_diff: float | None = None
    """The bound on the probe's log-prob difference after a push (rollout.max_logprob_abs_diff; None: no probe)."""
    host: str | None = None
    """The trainer's address the workers are told (None: $LIT_PPO_ROLLOUT_HOST, else 127.0.0.1)."""
