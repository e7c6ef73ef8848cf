"""Shared test code (no test module imports another; tests/test_layout.py checks it). Here: the fixture model
(FIXTURE_SHAPE), the config a test runs (composed through Hydra or built in code; `ppo_at`: a preset at a test's batch
sizes), its plan, a real run without Hydra (small batches on the tiny model, built by the product's
`lit_ppo.run.build.build_run_on_files`), `python train.py`'s run in this process (`fixture_run`), a stand-in engine
(`LastTokenEngine`) and what a run writes. Beside it: `cli_runs` (`python train.py` in its own
process), `resume` (comparing runs' states), `prompts` (prompts of real lengths), `episodes` (a calculator for
multi-turn episodes), `packing` (the LM head by hand), `fixed_batch` (a real rollout step on a fixed batch), `asynchronous` (runs with rollout workers)."""

from __future__ import annotations

import csv
import dataclasses
import json
import socket
from pathlib import Path

from lit_ppo.config import ModelConfig, PPOConfig, RolloutConfig, RunConfig, StrategyConfig, TrainerConfig
from lit_ppo.contract import Generation
from lit_ppo.plan import StepPlan, compute_plan
from lit_ppo.rewards import RewardScorer, integer_match
from lit_ppo.rollout.datamodule import RolloutDataModule
from lit_ppo.run.build import build_run_on_files

# The Hydra config `python train.py <overrides>` would run, composed in this process, and its typed settings.
from lit_ppo.run.entry import CONF_DIR, compose_run_config  # noqa: F401
from lit_ppo.run.entry import compose as compose_config  # noqa: F401
from lit_ppo.testing import NullEngine

ROOT = Path(__file__).resolve().parents[2]
CONF = CONF_DIR
# The tiny architecture of the shared `engine` fixture (tests/conftest.py), so in-process runs can reuse that engine:
# `model.tiny`'s settings, and as the overrides of a run's config.
FIXTURE_SHAPE = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
FIXTURE_MODEL = [f"model.tiny.{name}={value}" for name, value in FIXTURE_SHAPE.items()]


def save_fixture_model(directory: Path, seed: int) -> str:
    """The fixture model (FIXTURE_MODEL's shape, the character tokenizer) with the random weights of `seed`, saved as
    a model directory: conftest's `tiny_model_dir` (seed 0) and any second model of its shape (a teacher)."""
    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, max_position_embeddings=128, seed=seed, **FIXTURE_SHAPE)
    return str(save_model_dir(model, tokenizer, directory))


def fixture_run(engine, tmp_path: Path, *overrides: str, out: Path | None = None) -> dict:
    """The summary of `python train.py`'s run in this process (`entry.run`) for two rollout steps on the fixture model
    (FIXTURE_MODEL, generating with the `engine` fixture; no warm start) over 64 train and 8 eval arithmetic prompts,
    `overrides` on top; its files in `out` (default `tmp_path`), the model cache in tmp_path/cache."""
    from lit_ppo.run import entry

    out = out or tmp_path
    common = ["trainer.total_rollout_steps=2", "model.warm_start.enabled=false", "data.n_train=64", "data.n_eval=8"]
    paths = [f"output_dir={out}", f"cache_dir={tmp_path / 'cache'}"]
    return entry.run(compose_run_config(*overrides, *common, *paths, *FIXTURE_MODEL), out, engine=engine)


def dataclass_defaults(cls: type) -> dict:
    """Each field's default, nested config sections as dicts."""
    defaults = {}
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        defaults[f.name] = dataclass_defaults(type(value)) if dataclasses.is_dataclass(value) else value
    return defaults


def run_config(
    *,
    ppo: PPOConfig | None = None,
    rollout: RolloutConfig | None = None,
    steps: int | None = 1,
    data_epochs: float | None = None,
    dp: int = 1,
    precision: str = "32-true",
    accelerator: str = "cpu",
    **sections,
) -> RunConfig:
    """A RunConfig built in code: the given sections, `steps` rollout steps (or `data_epochs`), `dp` ranks (CPU
    unless `accelerator` says) in `precision` (float32 unless a test asks: `auto` would follow this machine's bf16
    support)."""
    return RunConfig(
        ppo=ppo or PPOConfig(),
        rollout=rollout or RolloutConfig(),
        trainer=TrainerConfig(total_rollout_steps=steps, data_epochs=data_epochs),
        strategy=StrategyConfig(accelerator=accelerator, devices=dp, precision=precision),
        **sections,
    )


def ppo_at(prompts: int, n: int, train: int, micro: int, preset: str = "ppo", **changes) -> PPOConfig:
    """conf/ppo/<preset>.yaml's settings at a test's batch sizes: `prompts` prompts x `n` samples per rollout step,
    mini-batches of `train` samples in micro-batches of `micro`; `changes` on top."""
    batches = dict(
        rollout_batch_size=prompts, n_samples_per_prompt=n, train_batch_size=train, micro_train_batch_size=micro
    )
    return dataclasses.replace(compose_run_config(f"ppo={preset}").ppo, **batches, **changes)


def distill_ppo(**changes) -> PPOConfig:
    """On-policy distillation's settings of the teacher tests: 3 prompts x 4 samples, one optimizer step of 12 samples
    in micro-batches of 6, no KL; `changes` on top."""
    batches = dict(rollout_batch_size=3, n_samples_per_prompt=4, train_batch_size=12, micro_train_batch_size=6)
    return PPOConfig(**{"advantage_estimator": "on_policy_distill", "kl_coef": 0.0, **batches, **changes})


def plan_of(dataset_prompts: int, **kwargs) -> StepPlan:
    """The product's plan (`compute_plan`) of `run_config(**kwargs)` over `dataset_prompts` prompts."""
    return compute_plan(run_config(**kwargs), dataset_prompts)


def datamodule_on(
    prompts,
    rollout: RolloutConfig,
    tokenizer,
    model_dir: str,
    engine=None,
    *,
    plan: StepPlan | None = None,
    ppo: PPOConfig | None = None,
    steps: int | None = 1,
    eval_prompts=None,
    reward_fn=integer_match,
    datamodule_class=RolloutDataModule,
    **kwargs,
) -> RolloutDataModule:
    """The data module (seed 0) of `prompts` generated by `engine`, scored by `reward_fn`: on `plan`, or the plan
    (`plan_of`) of `ppo`, `rollout` and `steps` over the prompts. `kwargs`: the data module's other arguments."""
    return datamodule_class(
        plan=plan or plan_of(len(prompts), ppo=ppo, rollout=rollout, steps=steps),
        train_prompts=prompts,
        eval_prompts=eval_prompts,
        rollout=rollout,
        scorer=RewardScorer(fn=reward_fn),
        tokenizer=tokenizer,
        model_dir=model_dir,
        seed=0,
        engine=engine,
        **kwargs,
    )


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV file (metrics.csv, sweep_summary.csv) as dicts of strings."""
    with open(path) as f:
        return list(csv.DictReader(f))


def rollout_step_rows(path: Path) -> list[dict]:
    """metrics.csv's rows of rollout steps 1, 2, ...: without its rollout_step 0 row (the evaluation before any
    update, which has no training metrics)."""
    return [row for row in read_csv(path) if float(row["rollout_step"]) > 0]


def build_run(
    model_dir: str,
    engine,
    files,
    tmp_path: Path,
    *,
    total_rollout_steps: int = 1,
    eval_every: int = 0,
    rollout: RolloutConfig | None = None,
    reward_fn=integer_match,
    callbacks=(),
    gradient_checkpointing=False,
    accelerator: str = "cpu",
    precision: str = "32-true",
    datamodule_class=RolloutDataModule,
    lora=None,
    teacher=None,
    on_error: str = "raise",
    **ppo_overrides,
):
    """(trainer, module, data module, plan) of a small run on the tiny model in this process (8 prompts x 4 samples,
    responses of 6 tokens, float32 on CPU unless told), built by the product's `build_run_on_files`."""
    ppo = PPOConfig(
        **{
            "rollout_batch_size": 8,
            "n_samples_per_prompt": 4,
            "train_batch_size": 8,
            "micro_train_batch_size": 4,
            "actor_lr": 1e-3,
            "critic_lr": 1e-3,
            **ppo_overrides,
        }
    )
    rollout = rollout or RolloutConfig(max_response_tokens=6, eval_samples_per_prompt=2)
    config = run_config(
        ppo=ppo,
        rollout=rollout,
        steps=total_rollout_steps,
        accelerator=accelerator,
        precision=precision,
        **({"model": ModelConfig(teacher=teacher)} if teacher else {}),  # on-policy distillation's
    )
    config = dataclasses.replace(
        config,
        trainer=dataclasses.replace(config.trainer, eval_every=eval_every),
        model=dataclasses.replace(
            config.model,
            gradient_checkpointing=gradient_checkpointing,
            **({"lora": lora} if lora else {}),
        ),
    )
    trainer, module, datamodule, plan = build_run_on_files(
        config,
        model_dir,
        files,
        scorer=RewardScorer(fn=reward_fn, on_error=on_error),
        output_dir=tmp_path,
        engine=engine,
        callbacks=callbacks,
        datamodule_class=datamodule_class,
    )
    return trainer, module, datamodule, plan


class LastTokenEngine(NullEngine):
    """Stands in for vLLM (in evaluation): response i of a prompt is i + 1 copies of the prompt's last token (text `i`,
    log-prob 0 each)."""

    def generate(self, request):
        return [
            Generation(
                prompt_index=p, token_ids=[ids[-1]] * (i + 1), truncated=False, text=str(i), logprobs=[0.0] * (i + 1)
            )
            for p, ids in enumerate(request.prompt_token_ids)
            for i in range(request.n)
        ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a store, a rank group or a worker)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def mark_interruptible_region(monkeypatch) -> list[bool]:
    """Replaces `preemption.interruptibly` by a stand-in that runs its function with `inside[0]` True meanwhile, and
    returns `inside`: what a test reads to see whether a call happened inside an interruptible region."""
    from lit_ppo import preemption

    inside = [False]

    def interruptibly(fn):
        inside[0] = True
        try:
            return fn()
        finally:
            inside[0] = False

    monkeypatch.setattr(preemption, "interruptibly", interruptibly)
    return inside
