"""The training run: model and data preparation, the Lightning trainer, and the run's output files.

Under data parallelism (strategy=ddp) every rank runs `train`: Lightning's launcher starts ranks > 0
as copies of the command when rank 0 reaches `trainer.fit`, so by then rank 0 has written the model
caches, which the other ranks only read; each rank prepared its own run once (`lit_ppo.run.prepare`:
its prompts and plan). Rank 0 alone writes the run's files.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import signal
import time
from pathlib import Path

import hydra
import lightning as L
import torch
import yaml
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_ppo import waits
from lit_ppo.atomic import (
    atomic_path,
)
from lit_ppo.checkpoints import RolloutCheckpoint, list_checkpoints
from lit_ppo.config import DataConfig, LoggerConfig, RunConfig
from lit_ppo.console import adopt_library_loggers, show
from lit_ppo.demo.arithmetic import problems_of, write_jsonl
from lit_ppo.demo.warmstart import (
    cache_key,
    demonstration_sampler,
    keyed_settings,
    supervised_warm_start,
    tool_demonstration_sampler,
)
from lit_ppo.errors import ConfigError, RolloutWorkerError
from lit_ppo.preemption import Preemption
from lit_ppo.resume import check_run_directory, finished_note, fresh_start_note, resolve_resume
from lit_ppo.rewards.scorer import RewardScorer
from lit_ppo.run.build import build_run, quiet_known_warnings
from lit_ppo.run.loggers import SampleTableLogger
from lit_ppo.run.prepare import PreparedRun, data_paths, prepare_run
from lit_ppo.run.report import write_curves, write_plan, write_summary
from lit_ppo.run.threads import allowed_cores
from lit_ppo.signals import Stopped, starting
from lit_ppo.topology import launcher_rank

log = logging.getLogger("lit_ppo")


def prepare_model(config: RunConfig, train_records: list[dict] | None) -> str:
    """The directory of the initial policy: a given model, or the tiny model (warm-started), cached."""
    model = config.model
    if model.path:
        return str(model.path)
    from lit_ppo.demo.tiny import (
        TOKENIZER_VERSION,
        build_char_tokenizer,
        build_tiny_model,
        save_model_dir,
    )

    cache = Path(config.cache_dir)
    tiny = dataclasses.asdict(model.tiny)
    base_dir = cache / f"tiny-{cache_key(tiny, config.seed, TOKENIZER_VERSION)}"
    if not (base_dir / "config.json").exists():
        tokenizer = build_char_tokenizer()
        with atomic_path(base_dir) as tmp:
            save_model_dir(build_tiny_model(tokenizer, seed=config.seed, **tiny), tokenizer, tmp)
    warm = model.warm_start
    if not warm.enabled:
        return str(base_dir)
    if train_records is None:
        raise ConfigError(
            "model.warm_start.enabled=true needs demonstrations from data.source=arithmetic; fix: set model.warm_start.enabled=false"
        )
    # Keyed on what the warm start reads: the base model, its own settings, the seed and the training records
    # themselves (not the data settings: data.n_eval or data.eval_path leave them as they are), and for tool
    # demonstrations the environment whose format they are written in.
    key_parts = [base_dir.name, keyed_settings(dataclasses.asdict(warm)), train_records, config.seed]
    environment = config.rollout.episodes.environment
    if warm.tool_call_rate is not None:
        key_parts.append(environment)
    key = cache_key(*key_parts)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if warm.tool_call_rate is not None:  # a teacher that sometimes calls the environment's tool
        from lit_ppo.environments import build_environment_factory

        make_environment = build_environment_factory(environment)
        if make_environment is None:
            raise ConfigError(
                "model.warm_start.tool_call_rate is set but rollout.episodes.environment is null; fix: set "
                "rollout.episodes.environment (the tool the demonstrations call) or remove tool_call_rate"
            )
        demos = tool_demonstration_sampler(
            train_records,
            tool_call_rate=warm.tool_call_rate,
            tool_use_practice=warm.tool_use_practice,
            environment=make_environment(),
        )
    else:
        demos = demonstration_sampler(
            train_records,
            teacher_accuracy=warm.teacher_accuracy,
            long_fraction=warm.long_fraction,
            long_pad_tokens=warm.long_pad_tokens,
        )
    out = supervised_warm_start(
        str(base_dir),
        cache / f"warm-{key}",
        demos,
        tokenizer,
        steps=warm.steps,
        batch_size=warm.batch_size,
        lr=warm.lr,
        seed=config.seed,
    )
    return str(out)


def prepare_data(data: DataConfig, output_dir: Path, write: bool = True, folder: str = "data"):
    """Train/eval prompt files (`data_paths`): generated for the arithmetic task into `output_dir/folder` (written when
    `write`), else the user's files; with the arithmetic training records. (The tests' and benchmarks' road to the
    product's files; a run writes the records its pre-flight generated: `write_generated_data`.)"""
    train_path, eval_path = data_paths(data, output_dir, folder)
    if data.source != "arithmetic":
        return train_path, eval_path, None
    train, evaluation = problems_of(data)
    if write:
        write_jsonl(train, train_path)
        write_jsonl(evaluation, eval_path)
    return train_path, eval_path, train


def write_generated_data(prepared: PreparedRun, output_dir: Path, folder: str) -> None:
    """The arithmetic task's records the run trains and evaluates on, into `output_dir/folder` for the user to read
    (the run reads them from its pre-flight); nothing for data=file."""
    if prepared.records is not None:
        for records, path in zip(prepared.records, data_paths(prepared.config.data, output_dir, folder)):
            write_jsonl(records, path)


def run_tokenizer(prepared: PreparedRun, model_dir: str):
    """The tokenizer the run saves with its policy: the pre-flight's, loaded from model.path, or for the tiny model the
    one saved beside the model built for it (the class AutoTokenizer picks from its config.json; the same ids as the
    pre-flight's, `lit_ppo.demo.tiny.build_char_tokenizer`, which read the prompts)."""
    return prepared.tokenizer if prepared.config.model.path else load_tokenizer(model_dir)


def load_tokenizer(model_dir: str):
    """The model's tokenizer, padding with its eos token where it has no pad token (padding is masked out; the
    pre-flight said so: preflight.pad_token_note)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_shared_engine(engine, config: RunConfig) -> None:
    """A vLLM engine given by the caller (the tests share one per process) serves one process only."""
    if engine is not None and config.strategy.name != "single":
        raise ConfigError(
            "a shared vLLM engine is for single-process runs; fix: pass engine=None (each rank starts its own)"
        )


class RolloutProgressBar(L.Callback):
    """A progress bar over rollout steps with the reward and seconds per step."""

    def __init__(self, total: int):
        self.total = total
        self.bar = None

    def on_train_start(self, trainer, module) -> None:
        if module.topology.is_rank_zero:
            self.bar = tqdm(
                total=self.total, initial=module.rollout_step, desc="rollout steps", unit="step", dynamic_ncols=True
            )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.bar is None or self.bar.n >= module.rollout_step:  # nothing new (e.g. the call that ends the stream)
            return
        row = module.history[-1]
        postfix = {"reward": f"{row['rollout/reward_mean']:.3f}", "s/step": f"{row['timing/rollout_step_s']:.1f}"}
        if "eval/reward" in row:
            postfix["eval"] = f"{row['eval/reward']:.3f}"
        self.bar.set_postfix(postfix)
        self.bar.update(module.rollout_step - self.bar.n)

    def on_train_end(self, trainer, module) -> None:
        if self.bar is not None:
            self.bar.close()

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        # Ended where it stands before the lines that end the run (the preemption line, an error): they start on a
        # line of their own, and the bar is not drawn again under them. (It is the first callback: its hook runs first.)
        self.on_train_end(trainer, module)


def extra_loggers(config: RunConfig, output_dir: Path, resume_from: Path | None = None) -> list:
    """The `logger` group's extra Lightning logger (W&B, TensorBoard), if any; metrics.csv is the module's own
    (resume-safe). `resume_from`: the checkpoint being resumed."""
    logger: LoggerConfig = config.logger
    if not logger.extra:
        return []
    extra = {"save_dir": str(output_dir)}
    parameters = inspect.signature(hydra.utils.get_object(logger.extra["_target_"])).parameters
    if "run_config" in parameters:
        # The run config, for trackers that record it; not instantiated recursively: its _target_ nodes are data here.
        extra.update(run_config=config.to_dict(), _recursive_=False, _convert_="all")
    if "resume_dir" in parameters and resume_from is not None:
        extra["resume_dir"] = str(Path(resume_from).parent.parent)  # <run>/checkpoints/<file>.ckpt
    return [hydra.utils.instantiate(logger.extra, **extra)]


class StartedRanks(L.Callback):
    """The ranks rank 0 started (Lightning's launcher), stopped by rank 0 after its error (`stop`): they would wait in
    their next collective (with NCCL, until the process-group timeout), and Lightning stops them only on Ctrl-C. (An
    error on another rank alone makes Lightning kill rank 0.)

    Lightning's observer thread SIGKILLs rank 0 as soon as a child exits with a non-zero code, which would cut rank
    0's own error message, exit code and exception checkpoint short where every rank stops together (the
    STOPPING_ERRORS): at an error rank 0 takes the children off its watch first (`on_exception`, before the
    checkpoint's, whose collectives hold the other ranks until rank 0 is there too)."""

    def __init__(self) -> None:
        self.children: list = []

    def take(self, trainer: L.Trainer) -> list:
        """The started ranks, off the observer's watch (it watches this very list)."""
        procs = getattr(trainer.strategy.launcher, "procs", None)
        if procs:
            self.children += procs
            procs.clear()
        return self.children

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        self.take(trainer)

    def stop(self, trainer: L.Trainer) -> None:
        for child in self.take(trainer):
            child.send_signal(signal.SIGKILL)
            child.wait()
        self.children = []


def lost_step_note(rollout_step: int, total_rollout_steps: int, checkpoints: Path, given_servers: bool) -> str:
    """What a rollout worker's failure during the rollout steps (`rollout_step`: the steps completed) costs, for the
    end of its line: the step it stopped in, the last checkpoint on disk, and how to continue."""
    kept = list_checkpoints(checkpoints)
    where = (
        f"the last checkpoint on disk is {kept[-1]}; continue from it with resume=auto"
        if kept
        else "no checkpoint was written yet (trainer.checkpoint_every); resume=auto starts the run again"
    )
    again = " once the servers given by rollout.workers.server_urls run again" if given_servers else ""
    if rollout_step >= total_rollout_steps:  # after the last step's updates (its evaluation, the final writes)
        return f"the run stopped after its last rollout step ({total_rollout_steps}); {where}{again}"
    return f"the run stopped in rollout step {rollout_step + 1} of {total_rollout_steps}, which is lost; {where}{again}"


def lightning_strategy(config: RunConfig):
    """The Lightning strategy of `strategy.lightning`, its process group's timeout `trainer.collective_timeout_s`
    (lit_ppo/waits.py); "auto" (Lightning's choice) when none is set."""
    if not config.strategy.lightning:
        return "auto"
    strategy_class = hydra.utils.get_class(config.strategy.lightning["_target_"])
    timeout = waits.strategy_timeout(strategy_class, config.trainer.collective_timeout_s)
    return hydra.utils.instantiate(config.strategy.lightning, **timeout)


def save_lora_policy(actor, tokenizer, output_dir: Path, merged: bool, adapter: dict | None = None) -> None:
    """The final LoRA policy: `actor/` a PEFT adapter directory (adapter_config.json naming the base, the adapter's
    tensors) that `peft` and vLLM's LoRARequest load, with the tokenizer; with `merged`, also `actor_merged/`, the
    adapter merged into the base weights as a plain Hugging Face model (in the base's dtype). The merge happens in
    place: the run is over. A sharded actor (FSDP) is written from its gathered `adapter` (`saved_actor_state`), and
    its merge is made on the base loaded again, whole, with that adapter (its own base is in shards)."""
    actor.save_pretrained(output_dir / "actor", state_dict=adapter)
    tokenizer.save_pretrained(output_dir / "actor")
    if merged:
        if adapter is None:
            whole = actor
        else:
            from peft import PeftModel

            base_dtype = actor.get_input_embeddings().weight.dtype  # the frozen base's (bf16 under bf16-mixed)
            base = AutoModelForCausalLM.from_pretrained(
                actor.peft_config["default"].base_model_name_or_path, dtype=base_dtype
            )
            whole = PeftModel.from_pretrained(base, output_dir / "actor")
        whole.merge_and_unload().save_pretrained(output_dir / "actor_merged")
        tokenizer.save_pretrained(output_dir / "actor_merged")


def train(config: RunConfig, output_dir: Path, engine=None, prepared: PreparedRun | None = None) -> dict | None:
    """Run the experiment and return its summary (None on ranks > 0, which write no files).

    `engine` lets a caller share one vLLM engine between single-process runs of the same architecture.
    `prepared`: this config's run as `lit_ppo.run.entry.run` prepared it (`prepare_run`: the pre-flight, the prompts,
    the plan); without it, prepared here the same way."""
    prepared = prepared or prepare_run(config, output_dir)
    config, plan = prepared.config, prepared.plan
    quiet_known_warnings()
    check_shared_engine(engine, config)
    adopt_library_loggers()  # Lightning's own console handler, added when it was imported
    starting()  # a signal from here to the first rollout step stops the run "during start-up"
    started = time.perf_counter()
    L.seed_everything(config.seed, workers=True)
    rank_zero = launcher_rank() == 0  # from the launcher's environment: the trainer does not exist yet
    if rank_zero:
        open_run_directory(config, output_dir)
    # Before any model loads (the warm start, the engine): a checkpoint that cannot be resumed from is named in one line
    # (resume=auto passes over it, with a warning, to the newest intact one).
    resume_from = resolve_resume(config.resume, output_dir / "checkpoints", announce=rank_zero)
    if rank_zero:
        write_generated_data(prepared, output_dir, "data")
    started_model = time.perf_counter()
    model_dir = prepare_model(config, prepared.records[0] if prepared.records else None)
    warm_start_seconds = time.perf_counter() - started_model
    tokenizer = run_tokenizer(prepared, model_dir)
    train_prompts, eval_prompts = prepared.train_prompts, prepared.eval_prompts
    finished = finished_note(config.resume, resume_from, plan.counts.total_rollout_steps, output_dir)
    if finished:  # before the plan.json of the finished run is rewritten and before any model loads
        if rank_zero:
            show(finished)
        return json.loads((output_dir / "summary.json").read_text()) if rank_zero else None
    if rank_zero:
        write_plan(plan, output_dir, prepared.dataset, config)

    scorer = RewardScorer.from_config(config)
    trainer_cfg = config.trainer
    checkpoints = RolloutCheckpoint(
        output_dir / "checkpoints", every=trainer_cfg.checkpoint_every, keep=trainer_cfg.keep_checkpoints
    )
    started_ranks = StartedRanks()
    if resume_from:
        log.info("resuming from %s", resume_from)
    elif plan.models.critic_enabled and rank_zero:  # (a resumed run's critic is its checkpoint's)
        show("critic: the policy's weights with a new value head, starting at zero")
    trainer, module, datamodule = build_run(
        config,
        plan,
        model_dir=model_dir,
        tokenizer=tokenizer,
        prompts=(train_prompts, eval_prompts),
        scorer=scorer,
        output_dir=output_dir,
        engine=engine,
        callbacks=[
            RolloutProgressBar(plan.counts.total_rollout_steps),
            started_ranks,  # before the checkpoint's: its on_exception first
            checkpoints,
            Preemption(checkpoints),
            SampleTableLogger(),
        ],
        loggers=extra_loggers(config, output_dir, resume_from),
        strategy=lightning_strategy(config),
    )
    actor_state = fit_run(
        trainer, module, datamodule, config, plan, resume_from, started_ranks, checkpoints, engine, scorer
    )
    if not module.topology.is_rank_zero:
        return None
    return write_outputs(
        config, plan, module, datamodule, tokenizer, train_prompts, output_dir, actor_state, started, warm_start_seconds
    )


def fit_run(
    trainer, module, datamodule, config: RunConfig, plan, resume_from, started_ranks, checkpoints, engine, scorer
):
    """Lightning's `fit` of the built run, from `resume_from` where given; a failure named (a wait that ran out, the
    rollout workers lost) and the engine and the reward workers closed whatever happened. Returns the actor's state
    gathered for rank 0 to save (sharded: every rank takes part), else None."""
    # The vLLM engine starts in datamodule.setup(), inside fit: a rank learns who it is only there.
    try:
        # weights_only=False: checkpoints written before the NumPy RNG state was stored as lists hold arrays.
        trainer.fit(
            module, datamodule=datamodule, ckpt_path=str(resume_from) if resume_from else None, weights_only=False
        )
        # Under FSDP every rank takes part in gathering the actor's shards (with LoRA the adapter's only), before the
        # engine's shutdown can touch the process group; rank 0 saves them (`write_outputs`).
        actor_state = module.saved_actor_state() if module.sharded else None
    except (Exception, Stopped) as error:  # (Stopped: a signal during start-up inside fit, e.g. the engine's start)
        started_ranks.stop(trainer)
        timed_out = waits.named_timeout(error, module.topology.rank)
        if timed_out is not None:
            raise timed_out from error
        if isinstance(error, RolloutWorkerError) and datamodule.engine is not None:  # the workers had started
            note = lost_step_note(
                module.rollout_step,
                plan.counts.total_rollout_steps,
                checkpoints.directory,
                bool(config.rollout.workers.server_urls),
            )
            raise RolloutWorkerError(f"{error}; {note}") from error
        raise
    finally:
        if engine is None and datamodule.engine is not None:  # free it for the next run in this process (a sweep)
            datamodule.engine.close()
        scorer.close()  # the reward worker processes, if any
    return actor_state


def write_outputs(
    config: RunConfig,
    plan,
    module,
    datamodule,
    tokenizer,
    train_prompts,
    output_dir: Path,
    actor_state,
    started: float,
    warm_start_seconds: float,
) -> dict:
    """Rank 0's files of a finished run: the trained actor (with LoRA its adapter, merged where asked), summary.json
    and the curves; its summary."""
    if module.lora:
        save_lora_policy(module.actor, tokenizer, output_dir, merged=config.model.lora.save_merged, adapter=actor_state)
    else:
        module.actor.save_pretrained(output_dir / "actor", state_dict=actor_state)
        tokenizer.save_pretrained(output_dir / "actor")
    extra = {
        "warm_start_seconds": warm_start_seconds,
        "engine_start_seconds": datamodule.engine_start_seconds,
        "data_parallel_size": plan.counts.data_parallel_size,
        "cpu_threads": torch.get_num_threads(),  # intra-op threads at the end (lit_ppo/run/threads.py)
        "cpu_cores_allowed": allowed_cores(),
        "wall_seconds": time.perf_counter() - started,
        "skipped_prompts": dict(train_prompts.skipped),
    }
    summary = write_summary(output_dir, module, plan, extra)
    write_curves(output_dir, module.history, module.eval_history)
    evaluated = (
        f"eval reward {summary['eval_reward_initial']:.3f} -> {summary['eval_reward_final']:.3f}"
        if summary["eval_reward_final"] is not None
        else "no evaluation (no data.eval_path)"
    )
    show(f"run finished: {evaluated} in {summary['wall_seconds']:.0f}s; outputs in {output_dir}")
    return summary


def open_run_directory(config: RunConfig, output_dir: Path) -> None:
    """Rank 0, before this run writes anything into `output_dir`: one run per directory (`check_run_directory`), the
    fresh start's note, and the run's config.yaml."""
    check_run_directory(config, output_dir)  # before this run writes anything into it
    note = fresh_start_note(config.resume, output_dir)
    if note:
        show(note)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
