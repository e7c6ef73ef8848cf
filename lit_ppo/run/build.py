"""One construction path: the Lightning trainer, `PPOModule` and `RolloutDataModule` of a run, wired from a plan.

`train.py` (through `lit_ppo.run.train.train`), the tests (`tests/helpers/`) and the benchmarks (`bench/common.py`) all
build their runs here, so the trainer flags the product depends on and the warning filters cannot drift apart. The tests'
and the benchmarks' in-process runs on prompt files, without train.py's data preparation and warm start:
`build_run_on_files`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import lightning as L

from lit_ppo.checkpoints import CheckpointFile
from lit_ppo.config import RunConfig
from lit_ppo.engine_registry import engine_row, start_engine
from lit_ppo.plan import StepPlan, compute_plan
from lit_ppo.rewards.scorer import RewardScorer
from lit_ppo.rollout.datamodule import RolloutDataModule
from lit_ppo.rollout.prompts import PromptSet, load_prompts
from lit_ppo.rollout.schedule import source_for
from lit_ppo.run.preflight import CHILD_START_METHODS, refuse_child_launcher
from lit_ppo.run.report import write_metrics_csv
from lit_ppo.topology import RankTopology
from lit_ppo.training.module import PPOModule

TRAINER_FLAGS: dict[str, Any] = dict(
    max_epochs=1,  # one Lightning epoch is the whole run: the data module streams plan.counts.total_rollout_steps batches
    enable_checkpointing=False,  # lit_ppo.checkpoints.RolloutCheckpoint saves per rollout step, atomically
    enable_progress_bar=False,  # training.RolloutProgressBar counts rollout steps, not Lightning batches
    enable_model_summary=False,
    use_distributed_sampler=False,  # the data module splits prompts over ranks itself (sampling seeds by position)
    num_sanity_val_steps=0,  # evaluation is the data module's, every trainer.eval_every rollout steps
    inference_mode=False,  # mode=eval's Trainer.validate evaluates as a training run does (lit_ppo/run/evaluate.py)
)
"""The Lightning `Trainer` flags lit-ppo depends on, whoever builds the run."""

QUIET_WARNINGS = [
    ".*dataloader_iter.*",  # we use that step flavor on purpose: generation must see the latest weights
    ".*does not have many workers.*",
    ".*exists and is not empty.*",
    ".*module\\(s\\) in eval mode.*",  # the frozen reference model
    ".*LeafSpec.*",
    ".*weights_only.*",
    ".*returned a view tensor.*",  # FSDP2 on the critic's output, which we only use out of place
    ".*validation_step.*but have no .val_dataloader.*",  # mode=eval's step (Trainer.validate); training evaluates in its steps
]
"""Library warnings about choices lit-ppo makes on purpose (the reasons beside each)."""


class MetricsCSV(L.Callback):
    """Keeps metrics.csv at `path` the module's rows (`PPOModule.history`, with `initial_row` as its rollout_step 0 row):
    rewritten on rank 0 after every rollout step, and after the evaluation before rollout step 1 of a run that starts
    from scratch (`PPOModule.on_train_start`), so a run that stops in its first step has that row."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_train_epoch_start(self, trainer: L.Trainer, module) -> None:
        # After `PPOModule.on_train_start`: the evaluation before rollout step 1, or (resumed) the one a signal cut
        # short after the last completed step, now in that step's row.
        initial = module.initial_row()
        if module.topology.is_rank_zero and (module.history or initial is not None):
            write_metrics_csv(self.path, module.history, initial=initial)

    def on_train_batch_end(self, trainer: L.Trainer, module, *args) -> None:
        if module.topology.is_rank_zero:
            write_metrics_csv(self.path, module.history, initial=module.initial_row())


def quiet_known_warnings() -> None:
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def build_run(
    config: RunConfig,
    plan: StepPlan,
    *,
    model_dir: str,
    tokenizer,
    prompts: tuple[PromptSet, PromptSet | None],
    scorer: RewardScorer,
    output_dir: str | Path,
    engine=None,
    callbacks: Sequence[L.Callback] = (),
    loggers: Sequence = (),
    strategy: Any = "auto",
    datamodule_class: type[RolloutDataModule] = RolloutDataModule,
) -> tuple[L.Trainer, PPOModule, RolloutDataModule]:
    """The trainer, module and data module of one run: `config` and its `plan`, the initial policy's directory and
    tokenizer, the (train, eval) prompts, the scorer, and where metrics.csv goes. `engine`: a vLLM engine to share
    (single process only); None starts one per rank in the data module's setup. `strategy`: the Lightning strategy
    built from `config.strategy.lightning`. With rollout.engine=hf the data module is given an `HFEngine` on the
    module's actor (colocated; rollout workers start HF engines of their own)."""
    quiet_known_warnings()
    train_prompts, eval_prompts = prompts
    datamodule = datamodule_class(
        plan=plan,
        train_prompts=train_prompts,
        eval_prompts=eval_prompts,
        rollout=config.rollout,
        scorer=scorer,
        tokenizer=tokenizer,
        model_dir=model_dir,
        seed=config.seed,
        engine=engine,
        chat_template=config.data.chat_template,
        source=source_for(plan, config.rollout.tensor_parallel_size),
    )
    datamodule.log_dir = Path(output_dir) / "logs"  # rollout.mode=disaggregated: the rollout workers' logs
    datamodule.attn_implementation = config.model.attn_implementation  # a rollout worker's HF engine loads with it
    module = PPOModule(
        model_dir=model_dir,
        ppo=config.ppo,
        plan=plan,
        pad_token_id=tokenizer.pad_token_id,
        gradient_checkpointing=config.model.gradient_checkpointing,
        eval_every=config.trainer.eval_every,
        max_consecutive_skipped_updates=config.trainer.max_consecutive_skipped_updates,
        temperature=config.rollout.temperature,
        max_logprob_abs_diff=config.rollout.max_logprob_abs_diff,
        lora=config.model.lora,
        attn_implementation=config.model.attn_implementation,
    )
    # An engine that shares the actor generates with the module's model, not a copy (rollout workers load their own):
    # started now, by the engine registry's factory, which starts every other engine in the data module's setup().
    if engine_row(config.rollout.engine, plan).shares_actor:
        if engine is not None:
            raise ValueError(
                f"build_run: rollout.engine={config.rollout.engine} generates with this run's actor; pass engine=None"
            )
        datamodule.engine = start_engine(datamodule, actor=module.actor)
    trainer = L.Trainer(
        accelerator=config.strategy.accelerator,
        devices=config.strategy.devices,
        num_nodes=config.strategy.num_nodes,
        strategy=strategy,
        precision=plan.models.precision,
        logger=list(loggers) or False,
        callbacks=[MetricsCSV(Path(output_dir) / "metrics.csv"), *callbacks],
        default_root_dir=str(output_dir),
        plugins=[CheckpointFile()],  # written beside its final name, not staged in $TMPDIR
        **TRAINER_FLAGS,
    )
    # Lightning's own choice (strategy.lightning null: "auto", ddp_notebook in a notebook) may start the ranks as this
    # process's children too, which the pre-flight could not see (`preflight.check_launcher`).
    method = getattr(trainer.strategy.launcher, "_start_method", None)
    if method in CHILD_START_METHODS:
        refuse_child_launcher(method)
    # Once per run, from the strategy's ranks (numbered as the trainer was built): the module, the data module and the
    # callbacks (through the module) read who this process is from it; the data module's setup checks it.
    module.topology = datamodule.topology = RankTopology.of(trainer, plan.counts.context_parallel_size)
    return trainer, module, datamodule


def build_run_on_files(
    config: RunConfig,
    model_dir: str | Path,
    prompt_files: tuple[str | Path, str | Path | None],
    *,
    scorer: RewardScorer,
    output_dir: str | Path,
    **build: Any,
) -> tuple[L.Trainer, PPOModule, RolloutDataModule, StepPlan]:
    """(trainer, module, data module, plan) of settings built in code, on the (train, eval) prompt files as they are
    (eval None: no evaluation) with the tokenizer of `model_dir`: the plan of those prompts (`compute_plan`), then
    `build_run` (`build`: its engine, callbacks, loggers, strategy, datamodule_class). No data preparation, warm start
    or pre-flight: `train.py`'s road from settings to a run is `lit_ppo.run.entry.run`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    train_file, eval_file = prompt_files
    train_prompts = load_prompts(train_file, tokenizer)
    eval_prompts = load_prompts(eval_file, tokenizer) if eval_file else None
    plan = compute_plan(config, len(train_prompts), train_prompts.stats())
    trainer, module, datamodule = build_run(
        config,
        plan,
        model_dir=str(model_dir),
        tokenizer=tokenizer,
        prompts=(train_prompts, eval_prompts),
        scorer=scorer,
        output_dir=output_dir,
        **build,
    )
    return trainer, module, datamodule, plan
