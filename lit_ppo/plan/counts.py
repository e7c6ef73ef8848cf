"""The counts every run has: prompts, samples, rollout steps, optimizer steps, the LR schedule's length; the sizes
every loop reads. The batch sizes are checked here (`check_batch_sizes`) before anything is derived from them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lit_ppo.config import PPOConfig, RunConfig, TrainerConfig, positive
from lit_ppo.errors import ConfigError
from lit_ppo.plan.table import Row


@dataclass(frozen=True)
class Counts:
    """The derived sizes of every run: prompts, samples, rollout steps, optimizer steps, the LR schedule's length."""

    data_parallel_size: int
    dataset_prompts: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    samples_per_rollout_step: int
    rollout_steps_per_data_epoch: int
    prompts_dropped_per_data_epoch: int
    total_rollout_steps: int
    data_epochs: float
    prompt_passes: float
    ppo_epochs: int
    train_batch_size: int
    mini_batches_per_ppo_epoch: int
    optimizer_steps_per_rollout_step: int
    total_optimizer_steps: int
    samples_per_rank_per_rollout_step: int
    total_samples_generated: int
    max_response_tokens: int  # the response width the trainer plans for (an episode's budget with episodes)
    max_tokens_generated: int
    lr_scheduler_unit: str
    lr_warmup_steps: int
    lr_total_steps: int
    # Generation rounds: a rollout step draws 1 round of prompts, or up to dynamic_sampling.max_generation_rounds;
    # the prompt order advances by rounds, generation_rounds_per_data_epoch of them per data epoch.
    prompts_per_generation_round: int
    generation_rounds_per_data_epoch: int
    # strategy.context_parallel_size (C): ranks sharing one data-parallel rank's samples, each 1/C of every row's
    # tokens (lit_ppo/training/context_parallel.py); data_parallel_size x C ranks in all
    context_parallel_size: int = 1

    @property
    def ranks(self) -> int:
        """Every trainer rank: data-parallel x context-parallel (what DDP averages gradients over)."""
        return self.data_parallel_size * self.context_parallel_size

    def rollout_rows(self) -> list[Row]:
        return [
            ("data-parallel size", self.data_parallel_size, "ranks"),
            *self.context_parallel_rows(),
            ("dataset", self.dataset_prompts, "prompts"),
            ("rollout batch", self.rollout_batch_size, "prompts / rollout step"),
            ("samples per prompt", self.n_samples_per_prompt, "responses"),
            ("samples per rollout step", self.samples_per_rollout_step, "responses"),
            ("rollout steps per data epoch", self.rollout_steps_per_data_epoch, "rollout steps"),
            (
                "prompts dropped per data epoch",
                self.prompts_dropped_per_data_epoch,
                "prompts (last partial rollout batch; reshuffled each data epoch)",
            ),
            ("total rollout steps", self.total_rollout_steps, "rollout steps"),
        ]

    def context_parallel_rows(self) -> list[Row]:
        if self.context_parallel_size == 1:
            return []
        return [
            (
                "context-parallel size",
                self.context_parallel_size,
                f"ranks per group sharing a data-parallel rank's samples, each 1/{self.context_parallel_size} of every "
                f"row's tokens (Ulysses; {self.ranks} ranks in all)",
            )
        ]

    def update_rows(self, critic: bool) -> list[Row]:
        """`critic`: whether a critic trains beside the actor (ModelsPlan.critic_enabled)."""
        return [
            ("data epochs", round(self.data_epochs, 3), "rollout steps / rollout steps per data epoch"),
            ("prompt passes", round(self.prompt_passes, 3), "prompts generated for / dataset prompts"),
            ("PPO epochs", self.ppo_epochs, "passes over each rollout batch"),
            ("train batch", self.train_batch_size, "samples / optimizer step"),
            ("mini-batches per PPO epoch", self.mini_batches_per_ppo_epoch, "optimizer steps"),
            (
                "optimizer steps per rollout step",
                self.optimizer_steps_per_rollout_step,
                "actor, and the critic as many" if critic else "actor (no critic)",
            ),
            ("total optimizer steps", self.total_optimizer_steps, "actor" + (" (critic the same)" if critic else "")),
        ]

    def total_rows(self, critic: bool, episodes: bool) -> list[Row]:
        """`critic`: as in `update_rows`; `episodes`: whether a sample is a multi-turn episode (EpisodesPlan)."""
        return [
            ("samples generated", self.total_samples_generated, "episodes" if episodes else "responses"),
            ("generated tokens (upper bound)", self.max_tokens_generated, "tokens"),
            ("LR warm-up", self.lr_warmup_steps, self.lr_scheduler_unit + "s"),
            ("LR schedule length", self.lr_total_steps, self.lr_scheduler_unit + "s"),
            ("critic", "yes" if critic else "no", ""),
        ]


def check_batch_sizes(ppo: PPOConfig, data_parallel_size: int, dataset_prompts: int) -> None:
    """The batch sizes divide into each other, over the ranks, within the dataset; else ConfigError naming the keys."""
    if not isinstance(data_parallel_size, int) or data_parallel_size <= 0:
        raise ConfigError(
            f"strategy.devices x strategy.num_nodes = {data_parallel_size} ranks; fix: use at least 1 device and 1 node"
        )
    if dataset_prompts <= 0:
        raise ConfigError(
            f"data: the prompt dataset is empty ({dataset_prompts} prompts); fix: point data at a file with prompts"
        )
    samples_per_rollout_step = ppo.rollout_batch_size * ppo.n_samples_per_prompt
    if samples_per_rollout_step % ppo.train_batch_size:
        raise ConfigError(
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} x ppo.n_samples_per_prompt={ppo.n_samples_per_prompt} "
            f"= {samples_per_rollout_step} samples is not a multiple of ppo.train_batch_size={ppo.train_batch_size}; "
            f"fix: make train_batch_size a divisor of {samples_per_rollout_step}"
        )
    per_update_per_rank = ppo.micro_train_batch_size * data_parallel_size
    if ppo.train_batch_size % per_update_per_rank:
        raise ConfigError(
            f"ppo.train_batch_size={ppo.train_batch_size} is not a multiple of ppo.micro_train_batch_size={ppo.micro_train_batch_size} "
            f"x data-parallel size {data_parallel_size} = {per_update_per_rank}; fix: choose micro_train_batch_size dividing "
            f"{ppo.train_batch_size // data_parallel_size if ppo.train_batch_size % data_parallel_size == 0 else 'train_batch_size / ranks'}"
        )
    if ppo.rollout_batch_size % data_parallel_size:
        raise ConfigError(
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} prompts cannot be split evenly over {data_parallel_size} ranks; "
            f"fix: use a multiple of {data_parallel_size}"
        )
    if ppo.rollout_batch_size > dataset_prompts:
        raise ConfigError(
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} prompts is larger than the dataset ({dataset_prompts} prompts); "
            f"fix: set ppo.rollout_batch_size to at most {dataset_prompts} or use more data"
        )


def prompts_per_generation_round(ppo: PPOConfig) -> int:
    """The prompts one generation round draws: the rollout batch, or ppo.dynamic_sampling.prompts_per_round."""
    ds = ppo.dynamic_sampling
    return (ds.prompts_per_round or ppo.rollout_batch_size) if ds.enabled else ppo.rollout_batch_size


def planned_rollout_steps(run: TrainerConfig, rollout_steps_per_data_epoch: int) -> int:
    """trainer.total_rollout_steps, or trainer.data_epochs in rollout steps (exactly one of the two is set)."""
    if (run.total_rollout_steps is None) == (run.data_epochs is None):
        raise ConfigError(
            f"trainer.total_rollout_steps={run.total_rollout_steps} and trainer.data_epochs={run.data_epochs}: "
            "set exactly one of the two; fix: e.g. trainer.total_rollout_steps=100 trainer.data_epochs=null"
        )
    if run.total_rollout_steps is not None:
        positive("trainer", total_rollout_steps=run.total_rollout_steps)
        return run.total_rollout_steps
    if run.data_epochs <= 0:
        raise ConfigError(f"trainer.data_epochs={run.data_epochs} must be positive; fix: e.g. trainer.data_epochs=1")
    return max(1, math.ceil(run.data_epochs * rollout_steps_per_data_epoch - 1e-9))


def counts_plan(config: RunConfig, dataset_prompts: int) -> Counts:
    """The sizes every run has, from the batch sizes (checked by `check_batch_sizes`) and the run's length."""
    ppo, data_parallel_size = config.ppo, config.strategy.data_parallel_size
    per_round = prompts_per_generation_round(ppo)
    rollout_steps_per_data_epoch = dataset_prompts // ppo.rollout_batch_size
    rounds_per_data_epoch = dataset_prompts // per_round
    total_rollout_steps = planned_rollout_steps(config.trainer, rollout_steps_per_data_epoch)
    samples_per_rollout_step = ppo.rollout_batch_size * ppo.n_samples_per_prompt
    mini_batches = samples_per_rollout_step // ppo.train_batch_size
    optimizer_steps_per_rollout_step = mini_batches * ppo.ppo_epochs
    total_optimizer_steps = optimizer_steps_per_rollout_step * total_rollout_steps
    samples = samples_per_rollout_step * total_rollout_steps
    response_width = config.rollout.episode_tokens() or config.rollout.max_response_tokens
    return Counts(
        data_parallel_size=data_parallel_size,
        dataset_prompts=dataset_prompts,
        rollout_batch_size=ppo.rollout_batch_size,
        n_samples_per_prompt=ppo.n_samples_per_prompt,
        samples_per_rollout_step=samples_per_rollout_step,
        rollout_steps_per_data_epoch=rollout_steps_per_data_epoch,
        prompts_dropped_per_data_epoch=dataset_prompts - rounds_per_data_epoch * per_round,
        total_rollout_steps=total_rollout_steps,
        data_epochs=total_rollout_steps / rollout_steps_per_data_epoch,
        prompt_passes=total_rollout_steps * ppo.rollout_batch_size / dataset_prompts,
        ppo_epochs=ppo.ppo_epochs,
        train_batch_size=ppo.train_batch_size,
        mini_batches_per_ppo_epoch=mini_batches,
        optimizer_steps_per_rollout_step=optimizer_steps_per_rollout_step,
        total_optimizer_steps=total_optimizer_steps,
        samples_per_rank_per_rollout_step=samples_per_rollout_step // data_parallel_size,
        total_samples_generated=samples,
        max_response_tokens=response_width,
        max_tokens_generated=samples * response_width,
        lr_scheduler_unit="optimizer_step",
        lr_warmup_steps=math.ceil(ppo.lr_warmup_ratio * total_optimizer_steps),
        lr_total_steps=total_optimizer_steps,
        prompts_per_generation_round=per_round,
        generation_rounds_per_data_epoch=rounds_per_data_epoch,
        context_parallel_size=config.strategy.context_parallel_size,
    )
