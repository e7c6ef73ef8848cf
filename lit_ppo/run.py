"""Everything `train.py` does: read the config, state the plan, prepare model and data, train, report."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from lit_ppo.config import RunConfig, planned_dataset_size
from lit_ppo.console import show
from lit_ppo.plan import compute_plan
from lit_ppo.report import write_plan

log = logging.getLogger("lit_ppo")


def output_dir_of(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if cfg.get("output_dir"):
        return Path(cfg.output_dir)
    return Path(HydraConfig.get().runtime.output_dir)


def main(cfg: DictConfig) -> dict | None:
    """Entry point behind `python train.py`; returns the summary (None in plan mode). The composed Hydra config
    becomes the typed `RunConfig` here, and nothing below this function reads the Hydra config."""
    config = RunConfig.from_hydra(cfg)
    output_dir = output_dir_of(cfg)
    size, source = planned_dataset_size(config.data)
    plan = compute_plan(config, size)
    if config.mode == "plan":
        write_plan(plan, output_dir, source, config)
        show(f"plan written to {output_dir / 'plan.json'}")
        return None
    from lit_ppo.training import train  # heavy imports only when training

    return train(config, output_dir)
