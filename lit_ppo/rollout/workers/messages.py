"""The commands the trainer queues for each rollout worker (rollout.mode=disaggregated), pickled through the store.
Their own module: a worker runs `python -m lit_ppo.rollout.disaggregated` (that module is its `__main__`), and
unpickles these classes from here, as the trainer pickled them."""

from __future__ import annotations

from dataclasses import dataclass

from lit_ppo.contract import Probe


@dataclass(frozen=True)
class Generate:
    """Generate `request` (VLLMEngine.generate's keywords) and store the result under `ticket`."""

    ticket: int
    request: dict


@dataclass(frozen=True)
class ApplyWeights:
    """Apply weight push number `push` (received by the worker's receiver thread) as policy version `policy_version`;
    with `peft_config` the push is an adapter, served as adapter `adapter_version`. `probe`: check the applied weights
    against the trainer's log-probs of a sequence."""

    push: int
    policy_version: int
    probe: Probe | None
    peft_config: dict | None = None
    adapter_version: int = 0


@dataclass(frozen=True)
class Stop:
    """Close the engine, join the worker's threads, acknowledge (`stopped/<worker>`) and exit 0."""
