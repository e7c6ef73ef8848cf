"""`mode=eval`: a model evaluated on the held-out prompts with the run's reward and sampling, and no training (verl's
`trainer.val_only`).

The same road as a training run's evaluation: the run is built by `build_run` (the same engine, strategy and
precision), and Lightning's `Trainer.validate` runs `PPOModule.validation_step`, which pushes the module's weights into
the engine and evaluates as `on_train_start` does before rollout step 1 (`RolloutDataModule.evaluate`: greedy reward
and response length, pass@k of `rollout.eval_samples_per_prompt` samples at `rollout.eval_temperature`, seeded by
`seed`). The model is `model.path` (any model, e.g. a run's `actor/`), or the tiny model, or with `resume` the actor
of a checkpoint (`resume=<path.ckpt>`, or `resume=auto`: the newest in output_dir/checkpoints) on the model it was
trained from. Writes `<output_dir>/eval.json` and nothing a training run writes (no config.yaml, metrics.csv,
checkpoints or actor/); arithmetic prompts go to `<output_dir>/eval_data/`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_ppo.atomic import write_text_atomic
from lit_ppo.config import RunConfig
from lit_ppo.console import adopt_library_loggers, show
from lit_ppo.engine_registry import engine_row
from lit_ppo.errors import ConfigError
from lit_ppo.plan import StepPlan
from lit_ppo.resume import resolve_resume
from lit_ppo.rewards.scorer import RewardScorer
from lit_ppo.rollout.datamodule import RolloutDataModule
from lit_ppo.run.build import build_run, quiet_known_warnings
from lit_ppo.run.loggers import format_samples
from lit_ppo.run.prepare import DATA_FOLDERS, PreparedRun, prepare_run
from lit_ppo.run.train import (
    check_shared_engine,
    lightning_strategy,
    prepare_model,
    run_tokenizer,
    write_generated_data,
)
from lit_ppo.signals import starting
from lit_ppo.topology import launcher_rank

EVAL_FILE = "eval.json"


def check_evaluation_settings(config: RunConfig, output_dir: Path) -> None:
    """What `mode=eval` needs before anything loads: held-out prompts, and with `resume` a checkpoint to evaluate,
    which it returns (None: the model itself), chosen once for the evaluation plan and the evaluation."""
    data = config.data
    if data.source == "arithmetic" and data.n_eval < 1:
        raise ConfigError(
            f"mode=eval: no evaluation prompts (data.n_eval={data.n_eval}); fix: data.n_eval=<number of held-out "
            "problems> (the default is 200)"
        )
    if data.source == "file" and not data.eval_path:
        raise ConfigError(
            "mode=eval: no evaluation prompts (data.eval_path is not set); fix: data.eval_path=<file of held-out "
            "prompts>, the file a training run evaluates on"
        )
    if data.source == "file" and not Path(data.eval_path).exists():
        raise ConfigError(
            f"mode=eval: data.eval_path={data.eval_path} does not exist; fix: point data.eval_path at the held-out "
            "prompts (JSONL, Parquet or a datasets folder)"
        )
    checkpoint = resolve_resume(config.resume, Path(output_dir) / "checkpoints")
    if config.resume == "auto" and checkpoint is None:
        raise ConfigError(
            f"mode=eval resume=auto: no checkpoint in {Path(output_dir) / 'checkpoints'} to evaluate; fix: "
            "output_dir=<the run's directory>, resume=<path.ckpt>, or model.path=<run>/actor without resume"
        )
    return checkpoint


def model_label(config: RunConfig, checkpoint: Path | None) -> str:
    """The model evaluated, in words: the checkpoint's actor, model.path, or the tiny model."""
    base = f"model.path={config.model.path}" if config.model.path else "the tiny model (model.tiny)"
    if config.model.path is None and config.model.warm_start.enabled:
        base += ", warm-started"
    return f"the actor of {checkpoint} (on {base})" if checkpoint is not None else base


def engine_description(plan: StepPlan, config: RunConfig) -> str:
    if plan.workers and plan.workers.server_urls:
        return f"the vLLM servers {', '.join(plan.workers.server_urls)}, the model's weights pushed to them first"
    return engine_row(config.rollout.engine, plan).describe(plan)


def evaluation_plan(prepared: PreparedRun, checkpoint: Path | None) -> str:
    """What `mode=eval` will do, printed before any model loads (in place of the training run's step plan)."""
    config, plan = prepared.config, prepared.plan
    rollout = config.rollout
    source = "generated arithmetic problems (data.n_eval)"
    if config.data.source != "arithmetic":  # those the pre-flight kept (data.bad_records, data.max_prompt_length)
        source = f"data.eval_path={config.data.eval_path}, as the run reads them"
    k = rollout.eval_samples_per_prompt
    rows = [
        ("model", model_label(config, checkpoint)),
        ("prompts", f"{len(prepared.eval_prompts)} held-out prompts: {source}"),
        ("greedy", "1 response per prompt at temperature 0: eval/reward, eval/response_length"),
        (
            "sampled",
            f"{k} responses per prompt at temperature {rollout.eval_temperature} (seed={config.seed}): eval/pass@{k}"
            if k > 1
            else "none (rollout.eval_samples_per_prompt=1: no pass@k)",
        ),
        ("responses", f"at most {rollout.max_response_tokens} tokens (rollout.max_response_tokens)"),
        ("reward", str(config.reward.fn.get("_target_"))),
        ("engine", engine_description(plan, config)),
        ("writes", "eval.json (no training, no checkpoint)"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = ["Evaluation (mode=eval)", "-" * (width + 60)]
    return "\n".join(lines + [f"{name:<{width}}  {value}" for name, value in rows])


class EvaluationDataModule(RolloutDataModule):
    """No rollout stream: one item for `Trainer.validate`, whose step evaluates (`PPOModule.validation_step`). (A
    training run's data module has no val_dataloader, so `Trainer.fit` runs no validation loop.)"""

    def val_dataloader(self) -> DataLoader:
        return DataLoader([0], batch_size=None)


def evaluate(
    config: RunConfig,
    output_dir: Path,
    engine=None,
    prepared: PreparedRun | None = None,
    checkpoint: Path | None = None,
) -> dict | None:
    """The evaluation of `mode=eval`: eval.json's record (None on ranks > 0, which write nothing). `engine`: a vLLM
    engine to share between single-process runs of one architecture (the tests'); the model's weights are pushed
    into it, as into any engine. `prepared`: this config's run as `lit_ppo.run.entry.run` prepared it (`prepare_run`:
    the pre-flight, the prompts, the plan); without it, prepared here the same way. `checkpoint`: the one
    `check_evaluation_settings` chose, given with `prepared` (without it, chosen here the same way)."""
    if prepared is None:
        checkpoint = check_evaluation_settings(config, output_dir)
        prepared = prepare_run(config, output_dir)
    config = prepared.config
    quiet_known_warnings()
    check_shared_engine(engine, config)
    adopt_library_loggers()
    starting()  # a signal from here on stops the evaluation in one line
    started = time.perf_counter()
    L.seed_everything(config.seed, workers=True)
    rank_zero = launcher_rank() == 0
    if rank_zero:  # the arithmetic prompts beside eval.json, not in data/: output_dir may be a run's own (resume=auto)
        write_generated_data(prepared, output_dir, DATA_FOLDERS["eval"])
    model_dir = prepare_model(config, prepared.records[0] if prepared.records else None)
    tokenizer = run_tokenizer(prepared, model_dir)
    train_prompts, eval_prompts = prepared.train_prompts, prepared.eval_prompts
    if not eval_prompts:
        raise ConfigError(
            f"mode=eval: none of the held-out prompts in {config.data.eval_path} is kept (each longer than "
            f"data.max_prompt_length={config.data.max_prompt_length} tokens, or empty); fix: raise "
            "data.max_prompt_length or check data.prompt_key"
        )
    plan = dataclasses.replace(prepared.plan, teacher=None)  # the student alone is evaluated: no teacher to load
    if checkpoint is None:  # only the actor generates: no critic or reference to load (a checkpoint restores them)
        plan = dataclasses.replace(
            plan, models=dataclasses.replace(plan.models, critic_enabled=False, reference_enabled=False)
        )
    scorer = RewardScorer.from_config(config)
    trainer, module, datamodule = build_run(
        config,
        plan,
        model_dir=model_dir,
        tokenizer=tokenizer,
        prompts=(train_prompts, eval_prompts),
        scorer=scorer,
        output_dir=output_dir,
        engine=engine,
        strategy=lightning_strategy(config),
        datamodule_class=EvaluationDataModule,
    )
    try:
        trainer.validate(
            module,
            datamodule=datamodule,
            ckpt_path=str(checkpoint) if checkpoint else None,
            verbose=False,
            weights_only=False,  # as a resumed run loads it (lit_ppo/run/train.py)
        )
    finally:
        if engine is None and datamodule.engine is not None:
            datamodule.engine.close()
        scorer.close()
    if not module.topology.is_rank_zero:
        return None
    return write_evaluation(config, plan, module, model_dir, checkpoint, eval_prompts, output_dir, started)


def write_evaluation(
    config: RunConfig,
    plan: StepPlan,
    module,
    model_dir,
    checkpoint: Path | None,
    eval_prompts,
    output_dir: Path,
    started,
) -> dict:
    """Rank 0's eval.json of the evaluation `module` made (its last `eval_history` entry), the greedy samples' table
    and the one line of its numbers; eval.json's record."""
    evaluation = module.eval_history[-1]
    metrics = {key: value for key, value in evaluation.items() if key.startswith("eval/")}
    label = model_label(config, checkpoint)
    record = {
        "model": label,
        "model_dir": str(model_dir),
        "checkpoint": str(checkpoint) if checkpoint else None,
        "rollout_step": module.rollout_step if checkpoint else None,
        "seed": config.seed,
        "eval_prompts": len(eval_prompts),
        "skipped_prompts": dict(eval_prompts.skipped),
        "samples_per_prompt": config.rollout.eval_samples_per_prompt,
        "eval_temperature": config.rollout.eval_temperature,
        "max_response_tokens": config.rollout.max_response_tokens,
        "engine": engine_description(plan, config),
        "metrics": metrics,
        "samples": evaluation["samples"],
        "cpu_threads": torch.get_num_threads(),
        "wall_seconds": time.perf_counter() - started,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output_dir / EVAL_FILE, json.dumps(record, indent=2))
    if evaluation["samples"]:  # the table a training run prints after each evaluation (run/loggers.py)
        show(
            f"eval samples of {label} (greedy, eval reward {metrics['eval/reward']:.3f}):\n"
            + format_samples(evaluation["samples"])
        )
    numbers = ", ".join(f"{key} {value:.3f}" for key, value in metrics.items())
    show(f"evaluation finished: {numbers} over {len(eval_prompts)} prompts; written to {output_dir / EVAL_FILE}")
    return record
