"""Building a real run (Lightning trainer, PPOModule, rollout data module) without Hydra, for tests."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from transformers import AutoTokenizer

from lit_ppo.config import PPOConfig, RolloutConfig, RunLengthConfig
from lit_ppo.datamodule import RolloutDataModule
from lit_ppo.module import PPOModule
from lit_ppo.plan import compute_plan
from lit_ppo.prompts import load_prompts
from lit_ppo.rewards import RewardScorer, integer_match


def build_run(model_dir: str, engine, files, tmp_path: Path, *, total_rollout_steps: int = 1, eval_every: int = 0,
              rollout: RolloutConfig | None = None, reward_fn=integer_match, callbacks=(), gradient_checkpointing=False,
              **ppo_overrides):
    ppo = PPOConfig(**{"rollout_batch_size": 8, "n_samples_per_prompt": 4, "train_batch_size": 8,
                       "micro_train_batch_size": 4, "actor_lr": 1e-3, "critic_lr": 1e-3, **ppo_overrides})
    rollout = rollout or RolloutConfig(max_response_length=6, eval_samples_per_prompt=2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_prompts = load_prompts(files[0], tokenizer)
    eval_prompts = load_prompts(files[1], tokenizer)
    plan = compute_plan(ppo, RunLengthConfig(total_rollout_steps=total_rollout_steps), len(train_prompts), 1,
                        rollout.max_response_length)
    datamodule = RolloutDataModule(plan=plan, train_prompts=train_prompts, eval_prompts=eval_prompts, rollout=rollout,
                                   scorer=RewardScorer(fn=reward_fn), tokenizer=tokenizer, model_dir=model_dir,
                                   seed=0, engine=engine)
    module = PPOModule(model_dir=model_dir, ppo=ppo, plan=plan, max_response_length=rollout.max_response_length,
                       pad_token_id=tokenizer.pad_token_id, eval_every=eval_every, gradient_checkpointing=gradient_checkpointing,
                       metrics_path=str(Path(tmp_path) / "metrics.csv"), temperature=rollout.temperature,
                       max_logprob_abs_diff=rollout.max_logprob_abs_diff)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        default_root_dir=str(tmp_path), callbacks=list(callbacks))
    return trainer, module, datamodule, plan
