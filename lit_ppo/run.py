"""Everything `train.py` does: read the config, state the plan, prepare model and data, train, report."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lit_ppo.console import show
from lit_ppo.memory import GIB, MemoryEstimate, MemoryInputs, ModelShape, estimate_memory
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


def model_shape(cfg: DictConfig) -> tuple[ModelShape | None, str]:
    """The model's shape without loading it: its config.json when model.path is a local directory, else the
    experiment's `model.architecture`, else the tiny model's settings; (None, why) when none is known."""
    model = cfg.model
    if model.get("path"):
        config_json = Path(str(model.path)) / "config.json"
        if config_json.exists():
            return ModelShape.from_hf_config(json.loads(config_json.read_text())), str(config_json)
        if model.get("architecture"):
            return ModelShape(**OmegaConf.to_container(model.architecture, resolve=True)), "model.architecture"
        return None, f"{config_json} is not on this machine and the experiment sets no model.architecture"
    from lit_ppo.tiny import tiny_vocab_size

    tiny = model.tiny
    return ModelShape(vocab_size=tiny_vocab_size(), hidden_size=int(tiny.hidden_size), intermediate_size=int(tiny.intermediate_size),
                      num_layers=int(tiny.num_layers), num_heads=int(tiny.num_heads), num_kv_heads=int(tiny.num_kv_heads),
                      tie_word_embeddings=True, attention_bias=True), "model.tiny"


def on_gpu(cfg: DictConfig) -> bool:
    accelerator = str(cfg.strategy.accelerator)
    if accelerator in ("gpu", "cuda"):
        return True
    if accelerator == "auto":
        import torch

        return torch.cuda.is_available()
    return False


def device_memory_gib(cfg: DictConfig) -> float | None:
    """strategy.device_memory_gib, else the first GPU's memory when there is one and the run uses GPUs."""
    if cfg.strategy.get("device_memory_gib"):
        return float(cfg.strategy.device_memory_gib)
    if on_gpu(cfg):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
    return None


def memory_estimate(cfg: DictConfig, plan: StepPlan) -> MemoryEstimate | None:
    shape, _ = model_shape(cfg)
    if shape is None:
        return None
    rollout = cfg.rollout
    return estimate_memory(shape, MemoryInputs(
        precision=plan.precision, strategy=str(cfg.strategy.name), data_parallel_size=plan.data_parallel_size,
        micro_batch_size=plan.micro_train_batch_size, prompt_tokens=int(cfg.data.max_prompt_length),
        response_tokens=int(rollout.max_response_length), gradient_checkpointing=bool(cfg.model.gradient_checkpointing),
        critic=plan.critic_enabled, reference=plan.reference_enabled, rollout_dtype=plan.rollout_dtype,
        rollout_sequences=plan.samples_per_rank_per_rollout_step, max_model_len=int(rollout.max_model_len),
        on_gpu=on_gpu(cfg), gpu_memory_utilization=float(rollout.gpu_memory_utilization),
        tensor_parallel_size=int(rollout.tensor_parallel_size), vllm_sleeps=bool(rollout.sleep_between_steps),
        cpu_kv_cache_gib=float(rollout.kv_cache_gib), device_memory_gib=device_memory_gib(cfg),
        grad_accumulation_steps=plan.grad_accumulation_steps))


def write_plan(plan: StepPlan, output_dir: Path, source: str, cfg: DictConfig | None = None) -> None:
    """plan.json and the printed tables: the step plan and, given the config, the memory estimate."""
    output_dir.mkdir(parents=True, exist_ok=True)
    record = plan.to_dict()
    show(plan.table().replace("Step plan", f"Step plan (dataset: {source})"))
    if cfg is not None:
        memory = memory_estimate(cfg, plan)
        shape_source = model_shape(cfg)[1]
        record["memory"] = None if memory is None else {**memory.to_dict(), "model_shape_from": shape_source}
        if memory is None:
            show(f"Memory per device: no estimate ({shape_source})")
        else:
            table = memory.table().replace("(estimate)", f"(estimate; model shape from {shape_source})")
            if cfg.mode == "plan":
                show(table)
            else:  # the console stays short while training: one line, the table in run.log and plan.json
                logging.getLogger("lit_ppo.console").info(table)
                show(f"memory per device (estimate): peak {memory.peak_bytes / GIB:.2f} GiB; "
                     "the table is in plan.json and logs/run.log (mode=plan prints it)")
    (output_dir / "plan.json").write_text(json.dumps(record, indent=2))


def main(cfg: DictConfig) -> dict | None:
    """Entry point behind `python train.py`; returns the summary (None in plan mode)."""
    if cfg.mode not in ("train", "plan"):
        raise ConfigError(f"mode={cfg.mode!r}; fix: use mode=train or mode=plan")
    output_dir = output_dir_of(cfg)
    size, source = planned_dataset_size(cfg)
    plan = make_plan(cfg, size)
    if cfg.mode == "plan":
        write_plan(plan, output_dir, source, cfg)
        show(f"plan written to {output_dir / 'plan.json'}")
        return None
    from lit_ppo.training import train  # heavy imports only when training

    return train(cfg, output_dir)
