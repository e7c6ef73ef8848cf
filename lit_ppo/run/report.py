"""The run's report files: plan.json (with the memory estimate of the config), metrics.csv, summary.json and curves.png."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
from pathlib import Path

from lit_ppo.atomic import (
    atomic_path,
    write_text_atomic,
)
from lit_ppo.config import ModelConfig, RunConfig, StrategyConfig
from lit_ppo.console import show
from lit_ppo.memory import GIB, MemoryEstimate, MemoryInputs, estimate_memory
from lit_ppo.model_shape import ModelShape
from lit_ppo.plan import StepPlan

log = logging.getLogger("lit_ppo")

TIMING_KEYS = {
    "generate_seconds": "timing/generate_s",
    "reward_seconds": "timing/reward_s",
    "experience_seconds": "timing/experience_s",
    "train_seconds": "timing/train_s",
    "weight_sync_seconds": "timing/weight_sync_s",
}


def write_metrics_csv(path: str | Path, history: list[dict], initial: dict | None = None) -> None:
    """metrics.csv, one row per rollout step, rewritten whole (atomically) so a resumed run has no gaps or repeats;
    `initial`, the evaluation before any update, is its rollout_step 0 row."""
    columns = ["rollout_step", "optimizer_step", "data_epoch", "samples_seen"]
    for row in [*history, *([initial] if initial else [])]:
        columns += [k for k in row if k not in columns]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows([initial, *history] if initial else history)


def write_summary(output_dir: Path, module, plan, extra: dict) -> dict:
    history, evals = module.history, module.eval_history
    summary = {
        "rollout_steps": module.rollout_step,
        "optimizer_steps_actor": module.actor_optimizer_steps,
        "optimizer_steps_critic": module.critic_optimizer_steps,
        "expected_optimizer_steps": plan.counts.total_optimizer_steps,
        "expected_optimizer_steps_critic": plan.counts.total_optimizer_steps if plan.models.critic_enabled else 0,
        "samples_generated": int(module.samples_seen),
        "tokens_generated": int(sum(row["rollout/generated_tokens"] for row in history)),
        "eval_reward_initial": evals[0]["eval/reward"] if evals else None,
        "eval_reward_final": evals[-1]["eval/reward"] if evals else None,
        "reward_final": history[-1]["rollout/reward_mean"] if history else None,
        "skipped_updates": module.skipped_updates,
    }
    if plan.dynamic_sampling:  # samples_generated counts the samples trained on; these count what was drawn
        keys = ["prompts_consumed", "generation_rounds", "dropped_groups", "filled_groups"]
        if plan.dynamic_sampling.rounds_requested_ahead is not None:  # rollout workers (docs/async.md)
            keys += ["refill_rounds", "returned_rounds"]
        for key in keys:
            summary[key] = int(sum(row.get(f"rollout/{key}", 0) for row in history))
    for key, metric in TIMING_KEYS.items():
        summary[key] = float(sum(row[metric] for row in history))  # every row has them: a missing one is a bug
    if evals:
        summary.update({f"eval_final/{k[5:]}": v for k, v in evals[-1].items() if k.startswith("eval/")})
        summary["eval_samples_final"] = evals[-1]["samples"]
    summary.update(extra)
    write_text_atomic(output_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def write_curves(output_dir: Path, history: list[dict], evals: list[dict]) -> Path:
    """curves.png: training reward, held-out accuracy, KL to the reference (the policy's entropy in a run without a
    reference model) and response length, against the rollout step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["rollout_step"] for row in history]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    # A run without a reference model (ppo.kl_coef=0, GRPO presets) logs no KL: its panel shows the policy's entropy.
    if any("rollout/kl_to_reference" in row for row in history) or not history:
        third = ("rollout/kl_to_reference", "KL to reference (per token)")
    else:
        third = ("actor/entropy", "policy entropy (per token; no reference model, no KL)")
    panels = [
        (axes[0, 0], "rollout/reward_mean", "training reward (mean)"),
        (axes[0, 1], None, "held-out greedy accuracy"),
        (axes[1, 0], *third),
        (axes[1, 1], "rollout/response_length_mean", "response length (tokens)"),
    ]
    for ax, key, title in panels:
        if key is None:
            ax.plot([e["rollout_step"] for e in evals], [e["eval/reward"] for e in evals], marker="o")
        else:
            ax.plot(steps, [row.get(key, float("nan")) for row in history])
        ax.set_title(title)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = output_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def model_shape(model: ModelConfig) -> tuple[ModelShape | None, str]:
    """The model's shape without loading it: its config.json when model.path is a local directory, else the
    experiment's `model.architecture`, else the tiny model's settings; (None, why) when none is known."""
    if model.path:
        config_json = Path(str(model.path)) / "config.json"
        if config_json.exists():
            return ModelShape.from_hf_config(json.loads(config_json.read_text())), str(config_json)
        if model.architecture:
            return model.architecture, "model.architecture"
        return None, f"{config_json} is not on this machine and the experiment sets no model.architecture"
    from lit_ppo.demo.tiny import tiny_vocab_size

    tiny = model.tiny
    if tiny is None:
        return None, "model.path and model.tiny are both null"
    return ModelShape(
        vocab_size=tiny_vocab_size(),
        hidden_size=int(tiny.hidden_size),
        intermediate_size=int(tiny.intermediate_size),
        num_layers=int(tiny.num_layers),
        num_heads=int(tiny.num_heads),
        num_kv_heads=int(tiny.num_kv_heads),
        tie_word_embeddings=True,
        attention_bias=True,
    ), "model.tiny"


def on_gpu(strategy: StrategyConfig) -> bool:
    accelerator = strategy.accelerator
    if accelerator in ("gpu", "cuda"):
        return True
    if accelerator == "auto":
        import torch

        return torch.cuda.is_available()
    return False


def device_memory_gib(strategy: StrategyConfig) -> float | None:
    """strategy.device_memory_gib, else the first GPU's memory when there is one and the run uses GPUs."""
    return device_memory(strategy)[0]


def device_memory(strategy: StrategyConfig) -> tuple[float | None, str]:
    """(device memory in GiB, where it comes from): the experiment's declared devices (strategy.accelerator and
    strategy.device_memory_gib), so that `mode=plan` away from them estimates for them, not for the machine it
    runs on; else the GPU found here when the run uses GPUs; else unknown."""
    kind = "GPU" if on_gpu(strategy) else strategy.accelerator
    if strategy.device_memory_gib:
        return float(strategy.device_memory_gib), f"{kind} of strategy.device_memory_gib"
    if on_gpu(strategy):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB, f"{torch.cuda.get_device_name(0)} found here"
        return None, "GPU of unknown memory (set strategy.device_memory_gib)"
    return None, "this machine's CPU"


def memory_estimate(config: RunConfig, plan: StepPlan) -> MemoryEstimate | None:
    shape, _ = model_shape(config.model)
    if shape is None:
        return None
    rollout, strategy = config.rollout, config.strategy
    return estimate_memory(
        shape,
        MemoryInputs(
            precision=plan.models.precision,
            strategy=strategy.name,
            data_parallel_size=plan.counts.data_parallel_size,
            context_parallel_size=plan.counts.context_parallel_size,
            micro_batch_size=plan.layout.micro_train_batch_size,
            prompt_tokens=config.data.max_prompt_length,
            response_tokens=plan.counts.max_response_tokens,
            gradient_checkpointing=config.model.gradient_checkpointing,
            critic=plan.models.critic_enabled,
            reference=plan.models.reference_enabled,
            rollout_dtype=plan.models.rollout_dtype,
            rollout_sequences=plan.counts.samples_per_rank_per_rollout_step,
            max_model_len=rollout.max_model_len,
            on_gpu=on_gpu(strategy),
            tensor_parallel_size=rollout.tensor_parallel_size,
            device_memory_gib=device_memory_gib(strategy),
            grad_accumulation_steps=plan.layout.grad_accumulation_steps,
            rollout_engine=rollout.engine,
            **rollout.engine_settings().memory_inputs(),  # the run's engine's own section (rollout.vllm, rollout.hf)
            lora_rank=plan.lora.rank if plan.lora else 0,
            lora_target_modules=config.model.lora.target_modules,
            lora_adapter_parameters=plan.lora.adapter_parameters if plan.lora else None,
            vllm_max_lora_rank=plan.lora.vllm_max_lora_rank if plan.lora else 0,
            rollout_workers=rollout.workers.count if rollout.mode == "disaggregated" else 0,
            workers_share_device=rollout.mode == "disaggregated" and rollout.workers.devices == 0 and on_gpu(strategy),
            max_staleness=rollout.staleness() if rollout.mode == "disaggregated" else 0,
            **teacher_memory_inputs(config, plan, shape),
        ),
    )


def teacher_memory_inputs(config: RunConfig, plan: StepPlan, student: ModelShape) -> dict:
    """The teacher's parameters for the memory estimate: from its config.json where it is on this machine, else the
    student's shape stands for it (said in its row). A server's teacher holds no memory of the trainer's."""
    if plan.teacher is None or plan.teacher.on_server:
        return {}
    shape, source = model_shape(dataclasses.replace(config.model, path=plan.teacher.path, architecture=None))
    if shape is None:
        shape, source = student, "the student's shape (its config.json is not on this machine)"
    return {
        "teacher_parameters": shape.parameters(),
        "teacher_dtype": plan.teacher.dtype,
        "teacher_shape_from": f"; shape: {source}",
    }


def write_plan(plan: StepPlan, output_dir: Path, source: str, config: RunConfig | None = None) -> None:
    """plan.json and the printed tables: the step plan and, given the config, the memory estimate."""
    output_dir.mkdir(parents=True, exist_ok=True)
    record = plan.to_dict()
    show(plan.table().replace("Step plan", f"Step plan (dataset: {source})"))
    if config is not None:
        memory = memory_estimate(config, plan)
        shape_source = model_shape(config.model)[1]
        device_source = device_memory(config.strategy)[1]
        record["memory"] = (
            None
            if memory is None
            else {**memory.to_dict(), "model_shape_from": shape_source, "device_from": device_source}
        )
        if memory is None:
            show(f"Memory per device: no estimate ({shape_source})")
        else:
            table = memory.table().replace(
                "(estimate)", f"(estimate; model shape from {shape_source}; device: {device_source})"
            )
            if config.mode == "plan":
                show(table)
            else:  # the console stays short while training: one line, the table in run.log and plan.json
                logging.getLogger("lit_ppo.console").info(table)
                show(
                    f"memory per device (estimate): peak {memory.peak_bytes / GIB:.2f} GiB; "
                    "the table is in plan.json and logs/run.log (mode=plan prints it)"
                )
    write_text_atomic(output_dir / "plan.json", json.dumps(record, indent=2))
