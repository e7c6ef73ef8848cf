"""How the trainer starts its rollout workers' client, by launch: the rows of lit_ppo/engine_registry.py for
rollout.mode=disaggregated name these (`start_workers`: spawned or external workers, each with an engine of its own,
the engine's `worker_settings` sent in its WorkerSpec and `worker_start` run by the worker; `start_servers`: vLLM
servers over HTTP). Which engine a worker runs is its registry row's; nothing here asks it."""

from __future__ import annotations

from pathlib import Path

from lit_ppo.engine_registry import engine_row
from lit_ppo.rollout.workers.client_settings import ClientSettings


def client_settings(datamodule) -> ClientSettings:
    """What every launch's client takes from the run's settings."""
    r, w = datamodule.rollout, datamodule.rollout.workers
    return ClientSettings(
        workers=w.count,
        devices_per_worker=w.devices,
        # The spawned workers' GPUs follow those of the trainer's ranks on rank 0's node.
        trainer_devices=datamodule.trainer.num_devices if datamodule.trainer is not None else 1,
        log_dir=datamodule.log_dir or Path("logs"),
        start_timeout_s=w.start_timeout_s,
        batch_timeout_s=w.batch_timeout_s,
        push_timeout_s=w.weight_push_timeout_s,
        bucket_mib=w.weight_push_bucket_mib,
        max_logprob_abs_diff=r.max_logprob_abs_diff,
        host=w.trainer_address_host(),
    )


def start_servers(datamodule, actor=None):
    """vLLM servers driven over HTTP (one trainer rank: config.validate_launch_in_run)."""
    from lit_ppo.rollout.workers.servers import ServerWorkers

    plan, w = datamodule.plan, datamodule.rollout.workers
    engine_kwargs = engine_row(datamodule.rollout.engine, plan).engine.settings_for_workers(datamodule, plan)
    return ServerWorkers(
        engine_kwargs=engine_kwargs, server_urls=list(w.server_urls), settings=client_settings(datamodule)
    )


def start_workers(datamodule, actor=None):
    """Rollout workers, spawned by the trainer or started by the user's launcher (rollout.workers.launch); with
    data-parallel trainers, rank 0 drives them and every rank receives each whole step (workers/ranks.py)."""
    from lit_ppo.rollout.workers.client import RolloutWorkers

    plan, w = datamodule.plan, datamodule.rollout.workers
    engine = engine_row(datamodule.rollout.engine, plan).engine
    start = lambda: RolloutWorkers(  # noqa: E731
        engine_kwargs=engine.settings_for_workers(datamodule, plan),
        engine_name=engine.name,
        episodes=datamodule.episode_spec(),  # multi-turn episodes: the workers build their environments
        launch=w.launch,
        port=w.port if w.launch == "external" else 0,
        heartbeat_timeout_s=w.heartbeat_timeout_s,
        settings=client_settings(datamodule),
    )
    if not datamodule.topology.distributed:
        return start()
    from lit_ppo.rollout.workers.ranks import DataParallelWorkers

    return DataParallelWorkers.start(datamodule.topology.rank, datamodule.device, start)
