"""The engine registry: every rollout engine lit-ppo can start, keyed by (rollout.engine, launch) as verl keys its
rollouts by (name, mode), with what the rest of the code knows of each. Nothing outside config validation
(lit_ppo/config/) and the plan's rows (lit_ppo/plan/) asks an engine's name (tests/test_engine_registry.py): it reads
the engine's row.

The launch is where the engine runs: `colocated` (in the trainer's process, rollout.mode=colocated), or
rollout.workers.launch with rollout.mode=disaggregated: `spawn` and `external` (rollout workers, each with an engine of
its own) or `server` (vLLM servers over HTTP).

The functions a row names ("module:function") are imported when the engine starts, so this table sits on the bottom
floor (plain values: the memory estimate and the trainer read it) and starts nothing itself. Adding an engine (e.g.
SGLang): its module (a class of the contract, lit_ppo/contract.py, with the functions below), an `Engine` and its
launches' rows here, and its settings' section (a dataclass in lit_ppo/config/, a field of `RolloutConfig` named as
`Engine.section`, its keys in conf/rollout/vllm.yaml).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

COLOCATED = "colocated"
"""The launch of an engine in the trainer's process."""


@dataclass(frozen=True)
class Engine:
    """One engine (a value of rollout.engine): what every launch of it shares."""

    name: str
    label: str  # how messages name it
    section: str
    """Its own settings' section: `rollout.<section>` (a field of config/rollout.py's `RolloutConfig`), read outside
    config and plan only by its own modules (`RolloutConfig.engine_settings`)."""
    preallocates_kv_cache: bool
    """Holds its own copy of the weights and reserves its KV cache up front (vLLM's gpu_memory_utilization), where the
    memory estimate counts it; else the KV cache of each generate call, freed after it (Hugging Face generate)."""
    worker_settings: str
    """"module:function", (datamodule, plan) -> dict: the settings the trainer sends each rollout worker
    (WorkerSpec.engine), plain values."""
    worker_start: str
    """"module:function", settings -> the engine a rollout worker runs (a `WorkerWeightTransfer` too)."""
    processes_setting: str | None = None
    """The worker setting that counts each engine's processes (each joins the weight push's group); None: one."""

    def processes_per_worker(self, settings: dict) -> int:
        return int(settings.get(self.processes_setting, 1)) if self.processes_setting else 1

    def start_in_worker(self, settings: dict):
        return resolve(self.worker_start)(settings)

    def settings_for_workers(self, datamodule, plan) -> dict:
        return resolve(self.worker_settings)(datamodule, plan)


@dataclass(frozen=True)
class EngineRow:
    """One (engine, launch): how the trainer's process gets its engine, and what follows from it."""

    engine: Engine
    launch: str
    start: str
    """"module:function", (datamodule, actor) -> RolloutEngine: the engine the trainer's process generates with (the
    engine itself, or the client of its workers or servers). `actor`: the trainer's model, for an engine that shares
    it."""
    shares_actor: bool
    """Generates with the trainer's own tensors: no copy, nothing pushed, its samples record adapter version 0."""
    description: str
    """The engine in the evaluation's plan, formatted with the plan's `models` and `workers` sections."""
    starts_on_every_rank: bool = False
    """Its start is a collective over the trainer's ranks (vLLM's external_launcher builds its process groups with
    torch.distributed.new_group over the whole world): a rank that never generates with it (a context-parallel
    group's other ranks, lit_ppo/rollout/context_group.py) still starts it, and keeps it asleep."""

    def describe(self, plan) -> str:
        return self.description.format(models=plan.models, workers=plan.workers)


VLLM = Engine(
    name="vllm",
    label="vLLM",
    section="vllm",
    preallocates_kv_cache=True,
    worker_settings="lit_ppo.rollout.engine:worker_settings",
    worker_start="lit_ppo.rollout.engine:start_in_worker",
    processes_setting="tensor_parallel_size",
)
HF = Engine(
    name="hf",
    label="the HF engine",
    section="hf",
    preallocates_kv_cache=False,
    worker_settings="lit_ppo.rollout.hf_engine:worker_settings",
    worker_start="lit_ppo.rollout.hf_engine:start_in_worker",
)
ENGINES = {engine.name: engine for engine in (VLLM, HF)}
"""rollout.engine -> the engine (config/rollout.py takes its names from here)."""

WORKERS = "{workers.count} rollout worker(s) ({models.rollout_engine}, launch={workers.launch})"


def _rows() -> dict[tuple[str, str], EngineRow]:
    rows = [
        EngineRow(VLLM, COLOCATED, "lit_ppo.rollout.engine:start_colocated", False, "vLLM in this process ({models.rollout_dtype})", starts_on_every_rank=True),
        EngineRow(HF, COLOCATED, "lit_ppo.rollout.hf_engine:start_on_actor", True, "Hugging Face generate on the loaded model ({models.precision})"),
        EngineRow(VLLM, "server", "lit_ppo.rollout.workers.pools:start_servers", False, "{workers.count} vLLM server(s) the run spawns, the model's weights pushed to them first"),
    ]  # fmt: skip
    for engine in (VLLM, HF):  # rollout workers (spawned, or started by the user's launcher): the same client
        for launch in ("spawn", "external"):
            rows.append(EngineRow(engine, launch, "lit_ppo.rollout.workers.pools:start_workers", False, WORKERS))
    return {(row.engine.name, row.launch): row for row in rows}


REGISTRY: dict[tuple[str, str], EngineRow] = _rows()
"""(rollout.engine, launch) -> its row; a pair without a row is refused at config time (config/workers.py)."""


def launch_of(plan) -> str:
    """The plan's launch: its rollout workers' (rollout.workers.launch), or colocated."""
    return plan.workers.launch if plan.workers else COLOCATED


def engine_row(engine: str, plan) -> EngineRow:
    """The row of rollout.engine `engine` in the plan's launch."""
    return REGISTRY[(engine, launch_of(plan))]


def resolve(path: str):
    """The function a row names ("module:function"), imported now."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def start_engine(datamodule, actor=None):
    """The one factory: the engine of the data module's run (rollout.engine, in its plan's launch), started."""
    row = engine_row(datamodule.rollout.engine, datamodule.plan)
    return resolve(row.start)(datamodule, actor)
