"""Stand-ins that tests and benchmarks share when a run should train without generating (in the manner of
`lightning.pytorch.demos`): an engine that does nothing, a data module that serves one fixed rollout batch, and the
rollout batches for it, built from token ids (`rollout_batch_from_ids`) or from sizes (`synthetic_rollout_batch`)."""

from __future__ import annotations

import dataclasses

import torch

from lit_ppo.batch import RolloutBatch
from lit_ppo.contract import GenerateRequest, Generation, WeightUpdate
from lit_ppo.rollout.datamodule import RolloutDataModule


class NullEngine:
    """Stands in for vLLM where a run trains on a fixed batch (`FixedBatchDataModule`): an engine of the contract
    (`lit_ppo.contract.RolloutEngine`) that generates nothing and moves no weights."""

    adapter_version = 0

    def generate(self, request: GenerateRequest) -> list[Generation]:
        raise RuntimeError("NullEngine generates nothing: a run with it trains on FixedBatchDataModule's fixed batch")

    def update_weights(self, update: WeightUpdate) -> int:
        for _ in update.tensors or ():  # read as an engine reads them: under FSDP each is gathered from every rank
            pass
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


def rollout_batch_from_ids(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    samples_per_prompt: int,
    rewards: torch.Tensor | None = None,
    *,
    truncated: torch.Tensor | None = None,
    policy_masks: list[list[int]] | None = None,
) -> RolloutBatch:
    """The rollout batch of given token ids, as the data module hands one to the trainer: `prompt_ids` and
    `response_ids` per sample (the `samples_per_prompt` samples of a prompt contiguous), `rewards` [N] (default 0, 1,
    0, 1, ...: every group of two or more samples differs, so GRPO's advantages are not all 0), `truncated` [N] bool
    (default none), `policy_masks` per response token for multi-turn episodes (then `episode_ids` are prompt +
    response). No sampler made it: no rollout log-probs, no texts, no timings. The one place tests and benchmarks
    write out a `RolloutBatch`."""
    N = len(prompt_ids)
    assert len(response_ids) == N and N % samples_per_prompt == 0, (N, len(response_ids), samples_per_prompt)
    positions = [i // samples_per_prompt for i in range(N)]
    return RolloutBatch(
        rollout_step=0,
        data_epoch=0,
        prompt_positions=positions,
        dataset_indices=positions,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        rollout_logprobs=None,
        rewards=torch.tensor([float(i % 2) for i in range(N)]) if rewards is None else rewards,
        truncated=torch.zeros(N, dtype=torch.bool) if truncated is None else truncated,
        prompts=[""] * N,
        responses=[""] * N,
        references=[None] * N,
        generate_seconds=0.0,
        reward_seconds=0.0,
        reward_metrics={},
        policy_masks=policy_masks,
        episode_ids=None if policy_masks is None else [p + r for p, r in zip(prompt_ids, response_ids)],
    )


def synthetic_rollout_batch(
    prompts: int,
    samples_per_prompt: int,
    prompt_tokens: tuple[int, int],
    response_tokens: tuple[int, int],
    *,
    seed: int = 0,
    vocab: range = range(4, 40),
    observations: bool = False,
    rewards: torch.Tensor | None = None,
) -> RolloutBatch:
    """A rollout batch of sizes: `prompts` prompts of `prompt_tokens` (low, high: inclusive) random ids from `vocab`
    (4+: not a special token of the test tokenizers), `samples_per_prompt` responses each of `response_tokens` ids,
    `rewards` [N] (default 0, 1, 0, 1, ...: `rollout_batch_from_ids`). `observations`: a multi-turn episode's batch,
    where a response longer than 60 tokens holds one observation of 5-30 tokens (policy mask 0) at least 10 tokens from
    its start and 40 from its end. The same `seed` gives the same batch."""
    g = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        return torch.randint(
            vocab.start, vocab.stop, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g
        ).tolist()

    prompt_ids = [p for p in (ids(*prompt_tokens) for _ in range(prompts)) for _ in range(samples_per_prompt)]
    response_ids, masks = [], []
    for _ in prompt_ids:
        response = ids(*response_tokens)
        mask = [1] * len(response)
        if observations and len(response) > 60:  # an observation inside the response: the tool's answer
            start = int(torch.randint(10, len(response) - 40, (1,), generator=g))
            width = int(torch.randint(5, 31, (1,), generator=g))
            mask[start : start + width] = [0] * width
        response_ids.append(response)
        masks.append(mask)
    return rollout_batch_from_ids(
        prompt_ids, response_ids, samples_per_prompt, rewards, policy_masks=masks if observations else None
    )


def random_rollout_batch(
    prompt_ids: list[list[int]], samples_per_prompt: int, response_tokens: int, vocab: range, seed: int
) -> RolloutBatch:
    """`samples_per_prompt` random responses of exactly `response_tokens` ids from `vocab` per prompt (each cut at the
    response limit: truncated), and random 0/1 rewards."""
    g = torch.Generator().manual_seed(seed)
    sample_prompts = [p for p in prompt_ids for _ in range(samples_per_prompt)]
    N = len(sample_prompts)
    response_ids = torch.randint(vocab.start, vocab.stop, (N, response_tokens), generator=g).tolist()
    rewards = torch.randint(0, 2, (N,), generator=g).float()
    return rollout_batch_from_ids(
        sample_prompts, response_ids, samples_per_prompt, rewards, truncated=torch.ones(N, dtype=torch.bool)
    )
