"""What the trainer and its rollout workers send each other through the store (pickled), as frozen dataclasses: the
ordered commands the trainer queues for each worker, the run's spec, and what workers send back.

Their own module: a worker runs `python -m lit_ppo.rollout.workers` (whose `__main__` is not the trainer's), and
unpickles these classes from here, as the trainer pickled them."""

from __future__ import annotations

from dataclasses import dataclass

from lit_ppo.contract import GenerateRequest, Generation, Probe
from lit_ppo.rollout.episodes import EpisodeRequest, EpisodeSpec


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker reads first (`spec`): its engine's settings (`lit_ppo.engine_registry.ENGINES[engine_name]`), how
    long a weight bucket may take, the bound on the probe's log-prob difference, how many workers the trainer expects,
    and with multi-turn episodes the settings the worker builds its environments from (plain values, never live
    objects)."""

    engine: dict
    push_timeout_s: float
    max_logprob_abs_diff: float | None
    workers: int
    engine_name: str = "vllm"  # rollout.engine
    episodes: EpisodeSpec | None = None
    processes_per_engine: int = 1  # vLLM's tensor-parallel size: each of its processes joins the weight push's group


@dataclass(frozen=True)
class Hello:
    """An external worker's greeting (`hello/<worker>`): where it runs, for the trainer's messages."""

    hostname: str
    pid: int


@dataclass(frozen=True)
class Generate:
    """Generate `request` (the engine's `generate`, or multi-turn episodes: `EpisodeRunner.run`) and store the result
    under `ticket`."""

    ticket: int
    request: GenerateRequest | EpisodeRequest


@dataclass(frozen=True)
class InitWeightTransfer:
    """Join the weight-transfer group (`backend.GlooInitInfo`'s fields, less this worker's rank and address):
    the engine's `open_weight_transfer`, the first command every worker gets."""

    init_info: dict


@dataclass(frozen=True)
class ApplyWeights:
    """Load a received weight push (`updates`: its buckets' `backend.GlooUpdateInfo`s, received meanwhile
    by the engine's receiver) as policy version `policy_version`; with `peft_config` the push is an adapter, served as
    adapter `adapter_version`. `probe`: check the applied weights against the trainer's log-probs of a sequence."""

    updates: tuple
    policy_version: int
    probe: Probe | None
    peft_config: dict | None = None
    adapter_version: int = 0


@dataclass(frozen=True)
class Stop:
    """Close the engine, join the worker's threads, acknowledge (`stopped/<worker>`) and exit 0."""


@dataclass(frozen=True)
class Result:
    """A worker's answer to `Generate` (`result/<worker>/<ticket>`): its generations, the policy version that
    generated them, the seconds they took, and the warnings it logged meanwhile (e.g. episodes scored 0 after
    environment errors), which the trainer logs again."""

    generations: list[Generation]
    policy_version: int
    seconds: float
    warnings: tuple[str, ...] = ()
