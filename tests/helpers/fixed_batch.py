"""One real rollout step (Lightning trainer, PPOModule) on a fixed batch, without vLLM: the set-up that
tests/training/test_speed.py, test_packing.py and test_shared_prefix.py share (through `packing.train`)."""

from __future__ import annotations

from typing import Callable

import lightning as L
import torch
from transformers import AutoTokenizer

from lit_ppo.batch import RolloutBatch
from lit_ppo.config import PPOConfig, RolloutConfig
from lit_ppo.plan import StepPlan
from lit_ppo.rollout.prompts import load_prompts
from lit_ppo.run.build import TRAINER_FLAGS
from lit_ppo.testing import FixedBatchDataModule, NullEngine
from lit_ppo.topology import RankTopology
from lit_ppo.training.module import PPOModule
from tests.helpers import datamodule_on


def train_on_fixed_batch(
    model_dir,
    prompt_file,
    tmp_path,
    batch: RolloutBatch,
    ppo: PPOConfig,
    rollout: RolloutConfig,
    plan_for: Callable[[int], StepPlan],
    *,
    grads_of: str | None = "all",
    prepare: Callable[[PPOModule], None] | None = None,
    precision: str = "32-true",
    devices: int = 1,
    strategy="auto",
    **module_kwargs,
) -> tuple[PPOModule, list[dict]]:
    """Train the plan's rollout steps on `batch` (every step trains the same batch); returns the module and the
    gradients (before clipping) at each optimizer step: of every model (`grads_of="all"`), of the actor alone
    ("actor"), or none (None). `plan_for(number of training prompts)` makes the plan; `prepare(module)` runs before
    the fit (to add hooks); `precision`, `devices` and `strategy`: the Lightning trainer's (2 devices and a
    DDPStrategy in processes that a test started as ranks, tests/training/test_context_parallel.py)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_prompts = load_prompts(prompt_file, tokenizer)
    plan = plan_for(len(train_prompts))
    datamodule = datamodule_on(
        train_prompts, rollout, tokenizer, model_dir, NullEngine(), plan=plan, datamodule_class=FixedBatchDataModule
    )
    datamodule.fixed_batch = batch
    torch.manual_seed(0)
    module = PPOModule(model_dir=model_dir, ppo=ppo, plan=plan, pad_token_id=tokenizer.pad_token_id, **module_kwargs)
    step, grads = module.guarded_step, []

    class StepRecordingGrads:  # the module's guarded optimizer step, recording the gradients first
        def __call__(self, model, optimizer, scheduler, rollout_step):
            if grads_of == "all" or (grads_of == "actor" and model is module.actor):
                grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
            return step(model, optimizer, scheduler, rollout_step)

        def __getattr__(self, name):  # its counters
            return getattr(step, name)

    module.guarded_step = StepRecordingGrads()
    if prepare is not None:
        prepare(module)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        logger=False,
        default_root_dir=str(tmp_path),
        **TRAINER_FLAGS,
    )
    # as build_run: who this process is, from the trainer's strategy
    module.topology = datamodule.topology = RankTopology.of(trainer, plan.counts.context_parallel_size)
    trainer.fit(module, datamodule=datamodule)
    return module, grads
