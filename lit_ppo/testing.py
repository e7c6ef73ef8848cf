"""Stand-ins that tests and benchmarks share when a run should train without generating (in the manner of
`lightning.pytorch.demos`): an engine that does nothing, a data module that serves one fixed rollout batch, and a
random batch for it."""

from __future__ import annotations

import dataclasses

import torch

from lit_ppo.batch import RolloutBatch
from lit_ppo.contract import Generation, WeightUpdate
from lit_ppo.rollout.datamodule import RolloutDataModule


class NullEngine:
    """Stands in for vLLM where a run trains on a fixed batch (`FixedBatchDataModule`): an engine of the contract
    (`lit_ppo.contract.RolloutEngine`) that generates nothing and moves no weights."""

    adapter_version = 0

    def generate(self, prompt_token_ids: list[list[int]], **params) -> list[Generation]:
        raise RuntimeError("NullEngine generates nothing: a run with it trains on FixedBatchDataModule's fixed batch")

    def update_weights(self, update: WeightUpdate) -> int:
        return 0

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass


class FixedBatchDataModule(RolloutDataModule):
    """Serves `fixed_batch` (set it before `trainer.fit`) at every rollout step instead of generating one."""

    fixed_batch: RolloutBatch

    def produce_rollout(self, rollout_step: int) -> RolloutBatch:
        self.next_rollout_step = rollout_step + 1
        return dataclasses.replace(self.fixed_batch, rollout_step=rollout_step)


def random_rollout_batch(
    prompt_ids: list[list[int]], samples_per_prompt: int, response_tokens: int, vocab: range, seed: int
) -> RolloutBatch:
    """`samples_per_prompt` random responses of exactly `response_tokens` ids from `vocab` per prompt, and random 0/1
    rewards (so that GRPO's advantages are not all 0)."""
    g = torch.Generator().manual_seed(seed)
    sample_prompts = [p for p in prompt_ids for _ in range(samples_per_prompt)]
    N = len(sample_prompts)
    positions = [i for i in range(len(prompt_ids)) for _ in range(samples_per_prompt)]
    return RolloutBatch(
        rollout_step=0,
        data_epoch=0,
        prompt_positions=positions,
        dataset_indices=positions,
        prompt_ids=sample_prompts,
        response_ids=torch.randint(vocab.start, vocab.stop, (N, response_tokens), generator=g).tolist(),
        rollout_logprobs=None,
        rewards=torch.randint(0, 2, (N,), generator=g).float(),
        truncated=torch.ones(N, dtype=torch.bool),
        prompts=[""] * N,
        responses=[""] * N,
        references=[None] * N,
        generate_seconds=0.0,
        reward_seconds=0.0,
        reward_metrics={},
    )
