"""The stand-ins of lit_ppo/testing.py: the rollout batches tests and benchmarks train on without generating."""

from __future__ import annotations

import torch

from lit_ppo.testing import random_rollout_batch, rollout_batch_from_ids, synthetic_rollout_batch


def test_synthetic_rollout_batch_has_the_sizes_asked_for_and_the_same_seed_gives_the_same_batch():
    batch = synthetic_rollout_batch(3, 4, (5, 9), (1, 70), seed=1, vocab=range(4, 40))
    assert len(batch.prompt_ids) == len(batch.response_ids) == 12 and batch.rewards.shape == (12,)
    assert batch.prompt_positions == batch.dataset_indices == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    for group in range(3):  # the samples of a prompt share it, contiguously
        assert all(batch.prompt_ids[4 * group + k] == batch.prompt_ids[4 * group] for k in range(4))
    assert all(5 <= len(p) <= 9 for p in batch.prompt_ids) and all(1 <= len(r) <= 70 for r in batch.response_ids)
    assert all(4 <= t < 40 for ids in batch.prompt_ids + batch.response_ids for t in ids)
    assert batch.rewards.tolist() == [0.0, 1.0] * 6  # every group differs: GRPO's advantages are not all 0
    assert not batch.truncated.any() and batch.policy_masks is None and batch.episode_ids is None
    assert batch.rollout_logprobs is None  # no sampler made it
    again = synthetic_rollout_batch(3, 4, (5, 9), (1, 70), seed=1, vocab=range(4, 40))
    assert again.prompt_ids == batch.prompt_ids and again.response_ids == batch.response_ids
    other = synthetic_rollout_batch(3, 4, (5, 9), (1, 70), seed=2, vocab=range(4, 40))
    assert other.response_ids != batch.response_ids


def test_observations_sit_inside_long_responses_only():
    batch = synthetic_rollout_batch(4, 4, (100, 300), (1, 256), seed=0, observations=True)
    long = [i for i, r in enumerate(batch.response_ids) if len(r) > 60]
    assert long and len(long) < 16  # both kinds occur with this seed
    for i, (response, mask) in enumerate(zip(batch.response_ids, batch.policy_masks)):
        assert len(mask) == len(response)
        observed = [k for k, m in enumerate(mask) if m == 0]
        if i in long:  # one run of 5-30 tokens, at least 10 from the start and 40 from the end (before it is cut)
            assert 5 <= len(observed) <= 30 and observed == list(range(observed[0], observed[-1] + 1))
            assert observed[0] >= 10 and observed[0] < len(response) - 40
        else:
            assert observed == []
        assert batch.episode_ids[i] == batch.prompt_ids[i] + response


def test_rollout_batch_from_ids_keeps_what_it_is_given():
    truncated = torch.tensor([True, False])
    batch = rollout_batch_from_ids([[5, 6], [5, 6]], [[7], [8, 9]], 2, torch.tensor([0.5, 1.0]), truncated=truncated)
    assert batch.prompt_positions == [0, 0] and batch.rewards.tolist() == [0.5, 1.0]
    assert batch.truncated.tolist() == [True, False] and batch.response_ids == [[7], [8, 9]]


def test_random_rollout_batch_is_truncated_at_the_response_length():
    batch = random_rollout_batch([[5, 6, 7], [8]], 2, 5, range(4, 10), seed=0)
    assert [len(r) for r in batch.response_ids] == [5] * 4 and batch.truncated.all()
    assert batch.prompt_ids == [[5, 6, 7], [5, 6, 7], [8], [8]] and batch.prompt_positions == [0, 0, 1, 1]
    assert set(batch.rewards.tolist()) <= {0.0, 1.0}
