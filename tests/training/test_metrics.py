"""Tests of lit_ppo.training.metrics and lit_ppo.training.experience on hand-written tensors.

Every expected value is worked out by hand in a comment; the code under test never produces one.
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_ppo.config import PPOConfig
from lit_ppo.training.experience import Experience, loss_denominators, next_kl_coef
from lit_ppo.training.metrics import MeanOver, actor_loss_shares, rollout_metrics, unbiased_variance, update_metrics


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def experience(**fields) -> Experience:
    """Two samples of 2 and 3 response tokens (T = 3)."""
    base = dict(
        mask=t([[1, 1, 0], [1, 1, 1]]),
        old_logp=t([[-1, -1, 0], [-1, -1, -1]]),
        advantages=t([[1, 2, 9], [3, -1, 0]]),  # the 9 is off the mask
        returns=t([[1, 2, 7], [3, 4, 5]]),
        rewards=t([1, 0]),
    )
    return Experience(**{**base, **fields})


def test_rollout_metrics_of_a_policy_without_critic_or_reference():
    row = rollout_metrics(experience(), truncated=torch.tensor([False, True]), reward_metrics={"format": 0.5})
    assert row == pytest.approx(
        {
            "rollout/reward_mean": 0.5,  # (1 + 0) / 2
            "rollout/reward_std": math.sqrt(0.5),  # unbiased: ((1 - .5)^2 + (0 - .5)^2) / (2 - 1) = 0.5
            "rollout/response_length_mean": 2.5,  # (2 + 3) / 2
            "rollout/response_length_max": 3.0,
            "rollout/truncated_fraction": 0.5,
            "rollout/generated_tokens": 5.0,
            "rollout/advantage_mean": 1.0,  # (1 + 2 + 3 - 1 + 0) / 5 tokens
            "rollout/reward_format": 0.5,
        }
    )
    # No reference model: no KL is made up from zeros. No critic: no explained variance.
    assert "rollout/kl_to_reference" not in row and "critic/explained_variance" not in row


def test_rollout_metrics_with_reference_and_critic():
    exp = experience(
        ref_logp=t([[-1, -1, 0], [-1, -1, -1]]),
        kl=t([[0.1, 0.3, 0.0], [0.2, 0.0, 0.4]]),
        values=t([[1, 2, 7], [3, 4, 0]]),
    )
    row = rollout_metrics(exp, truncated=torch.tensor([False, False]), reward_metrics={})
    assert row["rollout/kl_to_reference"] == pytest.approx(0.2)  # (0.1 + 0.3 + 0.2 + 0 + 0.4) / 5 tokens
    # Masked tokens: returns 1, 2, 3, 4, 5 (var 2.5), residuals 0, 0, 0, 0, 5 (mean 1, var (4 * 1 + 16) / 4 = 5).
    assert row["critic/explained_variance"] == pytest.approx(1 - 5 / 2.5)
    assert row["rollout/truncated_fraction"] == 0.0


def test_uniform_reward_groups_are_counted_for_group_estimators():
    # Groups of 2: rewards (1, 1) are uniform, (0, 1) are not.
    exp = Experience(
        mask=torch.ones(4, 1),
        old_logp=torch.zeros(4, 1),
        advantages=torch.zeros(4, 1),
        returns=torch.zeros(4, 1),
        rewards=t([1, 1, 0, 1]),
    )
    row = rollout_metrics(exp, truncated=torch.zeros(4), reward_metrics={}, group_size=2)
    assert row["rollout/uniform_reward_groups"] == 1
    assert "rollout/uniform_reward_groups" not in rollout_metrics(exp, torch.zeros(4), {})


def test_rollout_metrics_are_those_of_all_ranks():
    """Two ranks holding the same samples: sums double, means stay; reward metrics are the ranks' mean."""
    row = rollout_metrics(
        experience(),
        torch.tensor([False, True]),
        {"format": 0.5},
        world_size=2,
        global_sum=lambda x: 2 * x,
        global_max=lambda x: x,
    )
    assert row["rollout/generated_tokens"] == 10.0  # 5 tokens on each rank
    assert row["rollout/response_length_mean"] == 2.5  # 10 tokens / 4 samples
    # Four rewards 1, 0, 1, 0: unbiased variance (4 * 0.25) / 3 = 1/3.
    assert row["rollout/reward_std"] == pytest.approx(math.sqrt(1 / 3))
    assert row["rollout/reward_format"] == pytest.approx(0.5)  # 0.5 / 2 from each of the two ranks


def test_unbiased_variance():
    assert unbiased_variance(6.0, 14.0, 3) == pytest.approx(1.0)  # values 1, 2, 3: mean 2, (1 + 0 + 1) / 2
    assert unbiased_variance(5.0, 25.0, 1) == 0.0  # one value: no spread


def test_mean_over_divides_by_events_not_additions():
    per_update = MeanOver("optimizer update")
    per_update.add({"critic/value_loss": 1.0})  # update 1 arrives in two micro-batch pieces
    per_update.add({"critic/value_loss": 2.0, "actor/grad_norm": 4.0})
    per_update.count()
    per_update.add({"critic/value_loss": 3.0, "actor/grad_norm": 2.0})
    per_update.count()
    assert per_update.means() == {"critic/value_loss": 3.0, "actor/grad_norm": 3.0}  # (1 + 2 + 3) / 2, (4 + 2) / 2
    assert MeanOver("micro-batch").means() == {}


@pytest.mark.parametrize(
    "mode, expected",
    [
        # kept tokens: sample 0 its 3, sample 1 its first (the rollout correction dropped the others)
        # policy loss (1 + 2 + 3 + 4) / 4 tokens; clipped 2 of 4 tokens; entropy (1 + 2 + 3 + 4) / 4
        ("token-mean", {"actor/policy_loss": 2.5, "actor/clip_fraction": 0.5, "actor/entropy": 2.5}),
        # per sample: (6 / 3 + 4 / 1) / 2 samples; clipped (1/3 + 1) / 2; entropy (2 + 4) / 2
        ("seq-mean-token-mean", {"actor/policy_loss": 3.0, "actor/clip_fraction": 2 / 3, "actor/entropy": 3.0}),
        # the loss: (6 + 4) / 2 samples, every token weighed alike, so the means are over tokens
        ("seq-mean-token-sum", {"actor/policy_loss": 5.0, "actor/clip_fraction": 0.5, "actor/entropy": 2.5}),
    ],
)
def test_actor_statistics_are_weighted_as_the_loss_aggregation_and_add_up_over_micro_batches(mode, expected):
    """Two samples in one micro-batch, or one each in two: the shares of the mini-batch's statistics add up to the same
    values, weighted as the configured loss aggregation weighs the tokens it keeps."""
    pg_tok, entropy = t([[1, 2, 3], [4, 8, 8]]), t([[1, 2, 3], [4, 8, 8]])
    clipped = torch.tensor([[True, False, False], [True, True, True]])
    logp, old_logp = t([[-1, -1, -1], [-2, -1, -1]]), t([[-1, -1, -1], [-1, -1, -1]])
    loss_mask = t([[1, 1, 1], [1, 0, 0]])
    agg = dict(num_tokens=t(4.0), num_seqs=t(2.0), max_len=3)
    whole = actor_loss_shares(pg_tok, clipped, logp, old_logp, entropy, loss_mask, mode, **agg)
    per_update = MeanOver("optimizer update")
    for row in ([0], [1]):  # two micro-batches (or two ranks) of one mini-batch
        per_update.add(
            actor_loss_shares(
                pg_tok[row], clipped[row], logp[row], old_logp[row], entropy[row], loss_mask[row], mode, **agg
            )
        )
    per_update.count()
    summed = update_metrics(per_update, 0.0, 0.0, device="cpu")
    # approx KL: 0.5 x (log ratio -1)^2 on sample 1's kept token only: a token mean 0.5 / 4, a sample mean (0 + 0.5) / 2
    kl = 0.25 if mode == "seq-mean-token-mean" else 0.125
    for key, value in {**expected, "actor/approx_kl": kl}.items():
        assert whole[key] == pytest.approx(value) and summed[key] == pytest.approx(value), key


def test_experience_rows_cut_samples_and_width_and_keep_missing_fields_missing():
    exp = experience(values=t([[1, 2, 7], [3, 4, 0]]))
    rows = exp.rows([1], 2)
    assert torch.equal(rows.mask, t([[1, 1]]))
    assert torch.equal(rows.advantages, t([[3, -1]]))
    assert torch.equal(rows.values, t([[3, 4]]))
    assert torch.equal(rows.rewards, t([0]))
    assert rows.ref_logp is None and rows.kl is None


def test_loss_denominators_count_the_whole_mini_batch():
    exp = experience(loss_mask=t([[1, 0, 0], [1, 1, 1]]))  # the rollout correction dropped one token of sample 0
    num_tokens, num_seqs, num_policy_tokens = loss_denominators(exp, [0, 1])
    assert (float(num_tokens), float(num_seqs), float(num_policy_tokens)) == (5.0, 2.0, 4.0)  # 2 + 3, 2, 1 + 3
    assert [float(x) for x in loss_denominators(exp, [1])] == [3.0, 1.0, 3.0]


def test_next_kl_coef_follows_the_adaptive_controller_and_otherwise_stays():
    exp = experience(kl=t([[0.1, 0.1, 5.0], [0.2, 0.0, 0.0]]))  # the 5.0 is off the mask
    adaptive = PPOConfig(kl_coef=0.05, adaptive_kl_target=0.1, adaptive_kl_horizon=10)
    # KL per sequence (0.1 + 0.1 + 0.2) / 2 = 0.2; error 0.2 / 0.1 - 1 = 1, clipped to 0.2; x (1 + 0.2 * 2 / 10)
    assert next_kl_coef(0.05, exp, adaptive, 2) == pytest.approx(0.05 * 1.04)
    assert next_kl_coef(0.05, exp, PPOConfig(kl_coef=0.05), 2) == 0.05  # no target: a fixed coefficient
    assert next_kl_coef(0.05, experience(), adaptive, 2) == 0.05  # no reference, no KL


@pytest.mark.parametrize(
    "rounds_ahead, generation_rounds, refill, returned",
    [
        (None, 3, 1, 0),  # the plan's 2 rounds requested ahead, 3 used: 1 refill round
        (None, 1, 0, 1),  # 1 of the 2 used: 1 returned
        (1, 3, 2, 0),  # kept by a checkpoint with 1 round ahead (before max_generation_rounds was raised): 2 refills
        (1, 1, 0, 0),
    ],
)
def test_refill_rounds_are_counted_against_the_rounds_the_batch_was_requested_with(
    rounds_ahead, generation_rounds, refill, returned
):
    """A step kept by a checkpoint written under other dynamic sampling settings (issue 55 item 8: the shortfall's fix,
    max_generation_rounds raised, then resume=auto) was requested with fewer rounds ahead than the resumed plan's 2:
    its further rounds are refill rounds, counted as such, not against the plan's 2."""
    from types import SimpleNamespace

    from lit_ppo.config import DynamicSamplingConfig, RolloutConfig
    from lit_ppo.training.metrics import refill_and_returned_rounds
    from tests.helpers import plan_of

    ds = DynamicSamplingConfig(enabled=True, max_generation_rounds=3, expected_informative_fraction=0.5)
    ppo = PPOConfig(
        rollout_batch_size=8, n_samples_per_prompt=4, train_batch_size=8, micro_train_batch_size=4,
        advantage_estimator="grpo", kl_coef=0.0, kl_mode="loss",
        dynamic_sampling=ds,
    )  # fmt: skip
    plan = plan_of(64, ppo=ppo, rollout=RolloutConfig(mode="disaggregated", max_staleness=1), steps=2)
    assert plan.dynamic_sampling.rounds_requested_ahead == 2  # 8 needed / (8 per round x 0.5 informative)
    batch = SimpleNamespace(generation_rounds=generation_rounds, rounds_ahead=rounds_ahead)
    assert refill_and_returned_rounds(batch, plan) == {
        "rollout/refill_rounds": refill,
        "rollout/returned_rounds": returned,
    }


def test_the_policy_version_lag_is_the_whole_batch_s_over_every_rank():
    """rollout/policy_version_lag: the mean over every rank's samples, not this rank's share. Rank 0 holds samples of
    versions 5, 5 at rollout step 5 (lag 0); rank 1 (the fake all-reduce adds its sums) two of version 3 (lag 2)."""
    from types import SimpleNamespace

    from lit_ppo.training.metrics import policy_version_lag

    rank0 = SimpleNamespace(rollout_step=5, policy_versions=[5, 5])
    rank1 = torch.tensor([4.0, 2.0], dtype=torch.float64)  # lags summed, samples
    assert policy_version_lag(rank0, global_sum=lambda x: x + rank1) == 1.0  # (0 + 0 + 2 + 2) / 4
    assert policy_version_lag(rank0) == 0.0  # one rank
    assert policy_version_lag(SimpleNamespace(rollout_step=4, policy_versions=[4, 3, 1])) == pytest.approx(4 / 3)
