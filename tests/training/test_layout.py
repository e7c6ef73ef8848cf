"""`MicroBatchLayout` (lit_ppo/training/layout.py): the micro-batches of each mini-batch, as
`PPOModule.train_on_experience` walks them. Their `last` flag is where the gradients are synchronised
(`distributed.gradient_sync`, tests/test_distributed.py::test_gradient_sync_syncs_once_per_optimizer_step_with_the_gradients_of_a_sync_per_micro_batch):
exactly once per mini-batch, on its last micro-batch."""

from __future__ import annotations

import pytest
import torch

from lit_ppo.plan import minibatch_schedule
from lit_ppo.testing import synthetic_rollout_batch
from lit_ppo.training.layout import MicroBatchLayout
from lit_ppo.training.rank_samples import rank_share
from tests.helpers import plan_of, ppo_at


@pytest.mark.parametrize(
    "packing, shared_prefix, budget, dp",
    [
        (False, False, None, 1),  # padded, micro-batches of 4 samples: 4 per mini-batch
        (True, False, None, 2),  # packed, rank 1's 8 samples of each mini-batch: 2 micro-batches
        (True, False, 700, 1),  # packed within a budget of real tokens: as many micro-batches as it takes
        (False, False, 1200, 2),  # padded within a budget of positions, rank 1's share
        (True, True, None, 1),  # each prompt group's prompt laid out once
    ],
    ids=["padded", "packed-rank1", "packed-budget", "padded-budget-rank1", "shared-prefix"],
)
def test_each_mini_batch_marks_exactly_its_last_micro_batch_last(packing, shared_prefix, budget, dp):
    """8 prompts of 100-160 tokens x 4 samples of 5-80 tokens, mini-batches of 16 samples, 2 PPO epochs: 4
    mini-batches per rollout step, each with its micro-batches in order, only the last of them marked last."""
    batch = synthetic_rollout_batch(8, 4, (100, 160), (5, 80), seed=1)
    ppo = ppo_at(8, 4, 16, 4, packing=packing, shared_prefix=shared_prefix, micro_train_max_tokens=budget, ppo_epochs=2)
    plan = plan_of(8, ppo=ppo, dp=dp)
    assert plan.layout.packing == packing and plan.layout.shared_prefix == shared_prefix
    layout = MicroBatchLayout(batch, ppo, plan, pad_token_id=0, device=torch.device("cpu"))
    marks_per_mini_batch = []
    for minibatches in minibatch_schedule(plan, len(batch.response_ids), torch.Generator().manual_seed(0)):
        for minibatch in minibatches:
            indices = rank_share(batch, minibatch, plan, dp - 1)
            micro_batches = list(layout.mini_batch(indices, rollout_step=0))
            assert sorted(i for idx, _, _ in micro_batches for i in idx) == sorted(indices)  # each sample once
            marks_per_mini_batch.append([last for _, _, last in micro_batches])
    assert len(marks_per_mini_batch) == plan.counts.optimizer_steps_per_rollout_step == 4
    for marks in marks_per_mini_batch:
        assert len(marks) >= 2, marks  # gradient accumulation: a sync skipped before the last
        assert marks == [False] * (len(marks) - 1) + [True], marks
    if budget is None:
        assert {len(marks) for marks in marks_per_mini_batch} == {plan.layout.grad_accumulation_steps}
    assert layout.micro_batches == sum(len(marks) for marks in marks_per_mini_batch)


@pytest.mark.parametrize("context_parallel_size", [1, 2])
def test_the_shared_prefix_layout_builds_no_dense_mask_under_context_parallelism(context_parallel_size, monkeypatch):
    """With C > 1 each rank builds the whole rows' mask itself over rows padded to a multiple of C (or none for one
    sample: `context_parallel.local_micro_batch`), so the micro-batches carry no [R, 1, L, L] mask of their own
    (256 MiB of bool at 16k tokens); with C = 1 the one-rank forward takes theirs."""
    import dataclasses

    from lit_ppo.plan import compute_plan
    from lit_ppo.training import shared_prefix
    from tests.helpers import run_config

    built = []
    monkeypatch.setattr(shared_prefix, "segment_mask", lambda s: built.append(s.shape) or torch.ones(1))
    batch = synthetic_rollout_batch(4, 4, (100, 160), (5, 80), seed=1)
    ppo = ppo_at(4, 4, 16, 4, packing=True, shared_prefix=True)
    config = run_config(ppo=ppo, dp=2)
    strategy = dataclasses.replace(config.strategy, name="ddp", context_parallel_size=context_parallel_size)
    plan = compute_plan(dataclasses.replace(config, strategy=strategy), 4)
    assert plan.layout.shared_prefix and plan.counts.context_parallel_size == context_parallel_size
    layout = MicroBatchLayout(batch, ppo, plan, pad_token_id=0, device=torch.device("cpu"))
    micro_batches = [mb for _, mb in layout.lay_out(layout.split(list(range(16))))]
    assert len(micro_batches) == 4 and all(mb.segments is not None for mb in micro_batches)
    dense = context_parallel_size == 1
    assert [mb.attention_mask is not None for mb in micro_batches] == [dense] * 4
    assert len(built) == (4 if dense else 0)
