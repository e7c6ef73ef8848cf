"""Everything `train.py` does: read the config, state the plan, prepare model and data, train, report."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lit_ppo.plan import ConfigError, PPOConfig, RunLengthConfig, StepPlan, compute_plan, parse_section, validate_ppo
from lit_ppo.precision import resolve_precision, resolve_rollout_dtype

log = logging.getLogger("lit_ppo")


def output_dir_of(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if cfg.get("output_dir"):
        return Path(cfg.output_dir)
    return Path(HydraConfig.get().runtime.output_dir)


def data_parallel_size(cfg: DictConfig) -> int:
    return int(cfg.strategy.devices) * int(cfg.strategy.num_nodes)


def count_records(path: Path) -> int:
    """Records in a prompt file without tokenizing them (for `mode=plan`)."""
    if path.suffix in (".jsonl", ".json"):
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    import datasets

    return len(datasets.load_from_disk(str(path)))


def planned_dataset_size(cfg: DictConfig) -> tuple[int, str]:
    """The number of training prompts, known before loading any model or tokenizer."""
    data = cfg.data
    if data.source == "arithmetic":
        return int(data.n_train), "generated arithmetic problems"
    path = Path(data.path)
    if path.exists():
        return count_records(path), f"records in {path} (before length filtering)"
    if data.get("expected_prompts"):
        return int(data.expected_prompts), f"data.expected_prompts ({path} is not on this machine)"
    raise ConfigError(f"data.path={path} does not exist; fix: point data.path at your prompt file (or set data.expected_prompts for mode=plan)")


def parse_config(cfg: DictConfig) -> tuple[PPOConfig, RunLengthConfig]:
    ppo = parse_section(PPOConfig, OmegaConf.to_container(cfg.ppo, resolve=True), "ppo")
    length = RunLengthConfig(total_rollout_steps=cfg.trainer.total_rollout_steps, data_epochs=cfg.trainer.data_epochs)
    validate_ppo(ppo)
    return ppo, length


def make_plan(cfg: DictConfig, dataset_prompts: int) -> StepPlan:
    ppo, length = parse_config(cfg)
    precision = resolve_precision(cfg.strategy.precision, cfg.strategy.accelerator)
    return compute_plan(ppo, length, dataset_prompts, data_parallel_size(cfg), int(cfg.rollout.max_response_length),
                        precision=precision, rollout_dtype=resolve_rollout_dtype(precision, cfg.rollout.get("dtype")),
                        top_p=float(cfg.rollout.top_p))


def write_plan(plan: StepPlan, output_dir: Path, source: str) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "plan.json").write_text(plan.to_json())
    print(plan.table().replace("Step plan", f"Step plan (dataset: {source})"), flush=True)


def main(cfg: DictConfig) -> dict | None:
    """Entry point behind `python train.py`; returns the summary (None in plan mode)."""
    if cfg.mode not in ("train", "plan"):
        raise ConfigError(f"mode={cfg.mode!r}; fix: use mode=train or mode=plan")
    output_dir = output_dir_of(cfg)
    size, source = planned_dataset_size(cfg)
    plan = make_plan(cfg, size)
    if cfg.mode == "plan":
        write_plan(plan, output_dir, source)
        print(f"plan written to {output_dir / 'plan.json'}")
        return None
    from lit_ppo.training import train  # heavy imports only when training

    return train(cfg, output_dir)
