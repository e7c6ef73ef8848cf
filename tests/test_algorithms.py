"""Tests of lit_ppo.algorithms.

Every expected value is written out by hand (the derivation is in a comment) or computed by an
independent plain-Python formula in this file; the code under test never produces an expected value.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from lit_ppo import algorithms as alg

F64 = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def close(got: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=got.dtype)
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def whiten_list(xs: list[float], eps: float = 1e-8) -> list[float]:
    """Independent reference: (x - mean) / sqrt(population var + eps) with a plain loop."""
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / len(xs)
    return [(x - mean) / math.sqrt(var + eps) for x in xs]


def scatter_valid(valid: list[list[float]], width: int) -> list[list[float]]:
    """Right-pad each row's valid values with zeros up to `width`."""
    return [row + [0.0] * (width - len(row)) for row in valid]


def flat_valid(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [float(v) for v in x[mask.bool()]]


# ================================================================== hand-computed estimators

# Two sequences of 3 and 2 tokens in a width of 4; padding holds garbage that must be ignored.
MASK_2x4 = t([[1, 1, 1, 0], [1, 1, 0, 0]])
REWARDS_2 = t([1.0, 2.0])
VALUES_2x4 = t([[0.5, 0.25, 1.0, 9.0], [1.0, 0.5, 7.0, 7.0]])
KL_2x4 = t([[0.1, 0.0, 0.2, 5.0], [0.0, 0.3, 4.0, 4.0]])
# token rewards (-kl, plus the reward on the last valid token):
#   row 0: [-0.1, 0.0, -0.2 + 1 = 0.8]     row 1: [0.0, -0.3 + 2 = 1.7]


def test_gae_unnormalized_by_hand():
    # gamma = 0.5, lam = 0.8 (gamma*lam = 0.4); V after the last valid token is 0.
    # row 0: t2: delta = 0.8 + 0.5*0    - 1.0  = -0.2    A2 = -0.2
    #        t1: delta = 0.0 + 0.5*1.0  - 0.25 =  0.25   A1 = 0.25 + 0.4*(-0.2) = 0.17
    #        t0: delta = -0.1 + 0.5*0.25 - 0.5 = -0.475  A0 = -0.475 + 0.4*0.17 = -0.407
    # row 1: t1: delta = 1.7 - 0.5 = 1.2                 A1 = 1.2
    #        t0: delta = 0.0 + 0.5*0.5 - 1.0 = -0.75     A0 = -0.75 + 0.4*1.2 = -0.27
    # returns = A + V on valid tokens.
    adv, ret = alg.gae(REWARDS_2, MASK_2x4, values=VALUES_2x4, kl_penalty=KL_2x4, gamma=0.5, lam=0.8, normalize=False)
    close(adv, [[-0.407, 0.17, -0.2, 0.0], [-0.27, 1.2, 0.0, 0.0]])
    close(ret, [[0.093, 0.42, 0.8, 0.0], [0.73, 1.7, 0.0, 0.0]])


def test_gae_gamma1_lam1_is_return_minus_value():
    # gamma = lam = 1: A_t = (sum of token rewards from t) - V_t.
    # row 0 returns-to-go [0.7, 0.8, 0.8] - V [0.5, 0.25, 1.0] = [0.2, 0.55, -0.2]
    # row 1 returns-to-go [1.7, 1.7]      - V [1.0, 0.5]       = [0.7, 1.2]
    adv, ret = alg.gae(REWARDS_2, MASK_2x4, values=VALUES_2x4, kl_penalty=KL_2x4, gamma=1.0, lam=1.0, normalize=False)
    close(adv, [[0.2, 0.55, -0.2, 0.0], [0.7, 1.2, 0.0, 0.0]])
    close(ret, [[0.7, 0.8, 0.8, 0.0], [1.7, 1.7, 0.0, 0.0]])


def test_gae_normalized_by_hand():
    # Same raw advantages as the unnormalized case, whitened over the 5 valid tokens
    # (population std); returns are not whitened.
    adv, ret = alg.gae(REWARDS_2, MASK_2x4, values=VALUES_2x4, kl_penalty=KL_2x4, gamma=0.5, lam=0.8, normalize=True)
    w = whiten_list([-0.407, 0.17, -0.2, -0.27, 1.2])
    close(adv, [[w[0], w[1], w[2], 0.0], [w[3], w[4], 0.0, 0.0]])
    close(ret, [[0.093, 0.42, 0.8, 0.0], [0.73, 1.7, 0.0, 0.0]])


def test_reinforce_pp_by_hand():
    # gamma = 0.5: row 0: G2 = 0.8, G1 = 0 + 0.5*0.8 = 0.4, G0 = -0.1 + 0.5*0.4 = 0.1
    #              row 1: G1 = 1.7, G0 = 0 + 0.5*1.7 = 0.85
    # advantages = returns whitened over the 5 valid tokens (population std).
    adv, ret = alg.reinforce_pp(REWARDS_2, MASK_2x4, kl_penalty=KL_2x4, gamma=0.5)
    close(ret, [[0.1, 0.4, 0.8, 0.0], [0.85, 1.7, 0.0, 0.0]])
    w = whiten_list([0.1, 0.4, 0.8, 0.85, 1.7])
    close(adv, [[w[0], w[1], w[2], 0.0], [w[3], w[4], 0.0, 0.0]])


def test_reinforce_pp_gamma1_by_hand():
    # gamma = 1: row 0 returns-to-go [0.7, 0.8, 0.8], row 1 [1.7, 1.7];
    # mean = 5.7/5 = 1.14, squared deviations sum = 1.052, var = 0.2104.
    adv, ret = alg.reinforce_pp(REWARDS_2, MASK_2x4, kl_penalty=KL_2x4, gamma=1.0)
    close(ret, [[0.7, 0.8, 0.8, 0.0], [1.7, 1.7, 0.0, 0.0]])
    s = math.sqrt(0.2104 + 1e-8)
    close(adv, [[-0.44 / s, -0.34 / s, -0.34 / s, 0.0], [0.56 / s, 0.56 / s, 0.0, 0.0]])


def test_reinforce_pp_baseline_by_hand():
    # groups of 2: rewards [1, 3 | 0, 0.5] -> group means 2, 0.25 -> centered [-1, 1, -0.25, 0.25]
    # gamma = 1, no KL: returns = centered reward on every valid token.
    rewards = t([1.0, 3.0, 0.0, 0.5])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv, ret = alg.reinforce_pp_baseline(rewards, mask, group_size=2, gamma=1.0)
    close(ret, [[-1, -1, 0], [1, 0, 0], [-0.25, -0.25, -0.25], [0.25, 0.25, 0]])
    w = whiten_list([-1, -1, 1, -0.25, -0.25, -0.25, 0.25, 0.25])
    close(adv, [[w[0], w[1], 0], [w[2], 0, 0], [w[3], w[4], w[5]], [w[6], w[7], 0]])


# One group of 3 with rewards [1, 0, 0] and responses of 2, 3 and 1 tokens.
MASK_3x4 = t([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
REWARDS_3 = t([1.0, 0.0, 0.0])
KL_3x4 = t([[0.25, 0.25, 9.0, 9.0], [0.1, 0.05, 0.05, 9.0], [0.5, 9.0, 9.0, 9.0]])  # valid sums 0.5, 0.2, 0.5


def broadcast(per_seq: list[float]) -> list[list[float]]:
    return [[a * float(m) for m in row] for a, row in zip(per_seq, MASK_3x4.tolist())]


def test_grpo_by_hand():
    # rewards [1, 0, 0]: mean 1/3, unbiased var = (4/9 + 1/9 + 1/9)/2 = 1/3, std = 1/sqrt(3)
    # scores: (2/3)*sqrt(3) = 2/sqrt(3), (-1/3)*sqrt(3) = -1/sqrt(3)   (eps=1e-6 is within atol)
    adv, ret = alg.grpo(REWARDS_3, MASK_3x4, group_size=3)
    expected = broadcast([2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)])
    close(adv, expected, atol=1e-5)
    close(ret, expected, atol=1e-5)


def test_grpo_without_kl_by_hand():
    # rewards [1, 0 | 3, 3]: group 1 mean 0.5, unbiased std sqrt(0.5) -> +-0.5/sqrt(0.5) = +-sqrt(0.5);
    # group 2 has zero spread -> advantage 0.
    mask = t([[1, 1], [1, 0], [1, 1], [1, 0]])
    adv, _ = alg.grpo(t([1.0, 0.0, 3.0, 3.0]), mask, group_size=2)
    r = math.sqrt(0.5)
    close(adv, [[r, r], [-r, 0], [0, 0], [0, 0]], atol=1e-5)


def test_dr_grpo_by_hand():
    # rewards [1, 0, 0] minus group mean 1/3 -> [2/3, -1/3, -1/3], no std division
    adv, ret = alg.dr_grpo(REWARDS_3, MASK_3x4, group_size=3)
    expected = broadcast([2 / 3, -1 / 3, -1 / 3])
    close(adv, expected)
    close(ret, expected)


def test_rloo_by_hand():
    # rewards [1, 0, 0]: r_i - mean of the other two -> [1 - 0, 0 - 0.5, 0 - 0.5]
    adv, ret = alg.rloo(REWARDS_3, MASK_3x4, group_size=3)
    expected = broadcast([1.0, -0.5, -0.5])
    close(adv, expected)
    close(ret, expected)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_uniform_group_gets_exactly_zero_advantage_and_kl_stays_out_of_the_reward(name):
    # Group 1 has rewards [1, 1, 1]: advantage exactly 0 whatever the tokens. A KL penalty in the reward
    # (kl_mode=reward) would move it by its KL noise (GRPO: to about +-1), so these estimators refuse it.
    rewards = torch.cat([REWARDS_3, t([1.0, 1.0, 1.0])])
    mask = torch.cat([MASK_3x4, MASK_3x4])
    adv, _ = alg.ADVANTAGE_ESTIMATORS[name](rewards, mask, group_size=3)
    assert torch.equal(adv[3:], torch.zeros(3, 4, dtype=F64))
    assert adv[:3].abs().sum() > 0
    with pytest.raises(ValueError, match="kl_mode=loss"):
        alg.ADVANTAGE_ESTIMATORS[name](rewards, mask, group_size=3, kl_penalty=torch.cat([KL_3x4, KL_3x4]))


def test_reinforce_pp_baseline_adds_kl_after_the_group_mean():
    # OpenRLHF's order: the group mean is of the task rewards only. Rewards [1, 1, 1] centre to 0, so each
    # token's return is minus its KL-to-go: row 0 [-(0.25 + 0.25), -0.25], row 1 [-0.2, -0.1, -0.05], row 2 [-0.5].
    _, returns = alg.reinforce_pp_baseline(t([1.0, 1.0, 1.0]), MASK_3x4, group_size=3, kl_penalty=KL_3x4, gamma=1.0)
    close(returns, [[-0.5, -0.25, 0, 0], [-0.2, -0.1, -0.05, 0], [-0.5, 0, 0, 0]])


def test_group_estimators_reject_partial_groups():
    mask = torch.ones(5, 2, dtype=F64)
    for name in alg.GROUP_ESTIMATORS:
        with pytest.raises(ValueError):
            alg.ADVANTAGE_ESTIMATORS[name](torch.zeros(5, dtype=F64), mask, group_size=2)


def test_empty_sequence_gets_zero_advantage():
    # A row with no valid tokens must not receive the reward anywhere.
    mask = t([[1, 1], [0, 0]])
    values = t([[0.0, 0.0], [3.0, 3.0]])
    adv, ret = alg.gae(t([1.0, 5.0]), mask, values=values, gamma=1.0, lam=1.0, normalize=False)
    close(adv, [[1.0, 1.0], [0.0, 0.0]])
    close(ret, [[1.0, 1.0], [0.0, 0.0]])
    _, ret = alg.reinforce_pp(t([1.0, 5.0]), mask, gamma=1.0)
    close(ret, [[1.0, 1.0], [0.0, 0.0]])


# ================================================================== KL estimators

LN2 = math.log(2.0)


def test_kl_estimators_by_hand():
    x = t([0.0, LN2, -LN2, 1.0])  # x = logp - ref_logp
    close(alg.kl_k1(x), [0.0, LN2, -LN2, 1.0])
    close(alg.kl_k2(x), [0.0, 0.5 * LN2**2, 0.5 * LN2**2, 0.5])
    # k3 = exp(-x) - 1 + x: [1-1+0, 0.5-1+ln2, 2-1-ln2, e^-1 - 1 + 1]
    close(alg.kl_k3(x), [0.0, LN2 - 0.5, 1.0 - LN2, math.exp(-1.0)])
    assert alg.KL_ESTIMATORS["k3"] is alg.kl_k3


def test_k1_k3_are_unbiased_for_kl_policy_reference():
    # Exact expectation over a discrete policy p: E_p[k3(log p - log q)] = E_p[q/p - 1 + log p/q] = KL(p||q).
    p = [0.5, 0.3, 0.2]
    q = [0.2, 0.2, 0.6]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    x = t([math.log(pi) - math.log(qi) for pi, qi in zip(p, q)])
    w = t(p)
    assert float((w * alg.kl_k1(x)).sum()) == pytest.approx(kl, abs=1e-12)
    assert float((w * alg.kl_k3(x)).sum()) == pytest.approx(kl, abs=1e-12)
    assert (alg.kl_k3(x) >= 0).all() and (alg.kl_k2(x) >= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_log_ratios_give_finite_bounded_loss_and_gradient(dtype):
    """A token at log-ratio -30 (or +-100, where exp overflows float32 and bf16) neither overflows nor
    swamps the others: the KL estimates stop at KL_CLAMP, the ratio at exp(+-LOG_RATIO_CLAMP), and the
    clamped tokens get no gradient."""
    x = torch.tensor([-30.0, -100.0, 100.0, 0.5], dtype=dtype, requires_grad=True)
    for name, estimator in alg.KL_ESTIMATORS.items():
        kl = estimator(x)
        assert torch.isfinite(kl).all() and kl.abs().max() <= alg.KL_CLAMP, (name, kl)
        (grad,) = torch.autograd.grad(kl.sum(), x)
        assert torch.isfinite(grad).all() and torch.equal(grad[:3], torch.zeros(3, dtype=dtype)), (name, grad)
    # k3 of -30 by hand: exp(30) - 1 - 30 = 1.07e13 before the clamp; 10 after it.
    assert float(alg.kl_k3(torch.tensor(-30.0))) == alg.KL_CLAMP
    old_logp = torch.zeros(4, dtype=dtype)
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=dtype)
    loss, _ = alg.ppo_policy_loss(x, old_logp, advantages, clip_ratio_low=0.2, clip_ratio_high=0.2)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), (loss, grad)
    # ratio at +100 is exp(20) = 4.85e8 (clamped), not inf; at -30 it is exp(-20) = 2.1e-9, not exp(-30).
    assert float(loss[2]) == pytest.approx(math.exp(20.0), rel=1e-2)
    # A = +1 at ratio exp(-20): max(-ratio, -(1 - 0.2)) is the unclipped -exp(-20), not -exp(-30).
    assert float(loss[0]) == pytest.approx(-math.exp(-20.0), rel=1e-2)


def test_adaptive_kl_coef_by_hand():
    # coef * (1 + clip(kl/target - 1, -0.2, 0.2) * n/horizon), n/horizon = 64/640 = 0.1
    assert alg.adaptive_kl_coef(0.1, 0.15, 0.1, 64, 640) == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # error 0.5 -> 0.2
    assert alg.adaptive_kl_coef(0.1, 0.09, 0.1, 64, 640) == pytest.approx(0.1 * (1 - 0.1 * 0.1))  # error -0.1
    assert alg.adaptive_kl_coef(0.1, 0.0, 0.1, 64, 640) == pytest.approx(0.1 * (1 - 0.2 * 0.1))  # error -1 -> -0.2
    assert alg.adaptive_kl_coef(0.1, 0.1, 0.1, 64, 640) == pytest.approx(0.1)


# ================================================================== losses

# clip_ratio_low = 0.2 -> lower bound 0.8; clip_ratio_high = 0.28 -> upper bound 1.28
RATIOS = [1.5, 0.5, 0.5, 1.5, 1.0, 4.0]
ADVS = [1.0, 1.0, -1.0, -1.0, 2.0, -1.0]
# per token: unclipped = -A*r, clipped = -A*clamp(r, 0.8, 1.28), loss = max
#  0: A=1,  r=1.5: -1.5 vs -1.28 -> -1.28, high clip active
#  1: A=1,  r=0.5: -0.5 vs -0.8  -> -0.5,  not active
#  2: A=-1, r=0.5:  0.5 vs  0.8  ->  0.8,  low clip active
#  3: A=-1, r=1.5:  1.5 vs  1.28 ->  1.5,  not active
#  4: A=2,  r=1.0: -2   vs -2    -> -2,    not active
#  5: A=-1, r=4.0:  4   vs  1.28 ->  4,    not active (dual clip c=3 bounds it at -A*c = 3)


def policy_inputs():
    old = t([[-1.0, -2.0, -0.5, -3.0, -1.2, -0.7]])
    logp = (old + t([[math.log(r) for r in RATIOS]])).requires_grad_(True)
    return logp, old, t([ADVS])


def test_policy_loss_low_and_high_clip():
    logp, old, adv = policy_inputs()
    loss, clip = alg.ppo_policy_loss(logp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(loss.detach(), [[-1.28, -0.5, 0.8, 1.5, -2.0, 4.0]])
    close(clip, [[1.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    # d loss / d logp: 0 where the clipped branch is taken, else -A*r
    loss.sum().backward()
    close(logp.grad, [[0.0, -0.5, 0.0, 1.5, -2.0, 4.0]])


def test_policy_loss_dual_clip():
    logp, old, adv = policy_inputs()
    loss, _ = alg.ppo_policy_loss(logp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=3.0)
    # only token 5 (A<0, loss 4 > -A*c = 3) changes; token 3 (1.5 < 3) and A>0 tokens are untouched
    close(loss.detach(), [[-1.28, -0.5, 0.8, 1.5, -2.0, 3.0]])
    loss.sum().backward()
    close(logp.grad, [[0.0, -0.5, 0.0, 1.5, -2.0, 0.0]])


def test_policy_loss_dual_clip_ignores_positive_advantage():
    # A = 1, r = 5: loss -1.28 (high clip); the dual clip bound (-A*c = -3) must not apply to A > 0.
    logp, old = t([[math.log(5.0)]]), t([[0.0]])
    loss, _ = alg.ppo_policy_loss(logp, old, t([[1.0]]), clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=3.0)
    close(loss, [[-1.28]])


def test_value_loss_by_hand():
    values, old, returns = t([1.0, 2.0, 0.0]), t([0.5, 1.0, 0.0]), t([2.0, 0.0, 1.0])
    # unclipped 0.5*(v-R)^2 = 0.5*[1, 4, 1]
    loss, flag = alg.value_loss(values, old, returns, value_clip=None)
    close(loss, [0.5, 2.0, 0.5])
    close(flag, [0.0, 0.0, 0.0])
    # clip 0.2: clipped values old + clamp(v-old) = [0.7, 1.2, 0.0]; (.-R)^2 = [1.69, 1.44, 1.0]
    # max with [1, 4, 1] -> [1.69, 4, 1]; halved -> [0.845, 2.0, 0.5]; clipped branch chosen only on token 0
    loss, flag = alg.value_loss(values, old, returns, value_clip=0.2)
    close(loss, [0.845, 2.0, 0.5])
    close(flag, [1.0, 0.0, 0.0])


# ================================================================== aggregation

AGG_LOSS = t([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 99.0, 99.0]])  # 99 sits on padding


def test_aggregate_loss_by_hand():
    m = MASK_2x4
    # token-mean: (1+2+3+4+5)/5
    close(alg.aggregate_loss(AGG_LOSS, m, "token-mean"), 3.0)
    # seq-mean-token-sum: (6 + 9)/2
    close(alg.aggregate_loss(AGG_LOSS, m, "seq-mean-token-sum"), 7.5)
    # seq-mean-token-mean: (6/3 + 9/2)/2
    close(alg.aggregate_loss(AGG_LOSS, m, "seq-mean-token-mean"), 3.25)
    # seq-mean-token-sum-norm: default max_len = width 4: (6/4 + 9/4)/2; max_len 10: (0.6 + 0.9)/2
    close(alg.aggregate_loss(AGG_LOSS, m, "seq-mean-token-sum-norm"), 1.875)
    close(alg.aggregate_loss(AGG_LOSS, m, "seq-mean-token-sum-norm", max_len=10), 0.75)


def test_aggregate_loss_with_global_counts():
    m = MASK_2x4
    close(alg.aggregate_loss(AGG_LOSS, m, "token-mean", num_tokens=10), 1.5)  # 15/10
    close(alg.aggregate_loss(AGG_LOSS, m, "seq-mean-token-sum", num_seqs=5), 3.0)  # 15/5
    close(alg.aggregate_loss(AGG_LOSS, m, "seq-mean-token-mean", num_seqs=t(5.0)), 1.3)  # 6.5/5
    close(alg.aggregate_loss(AGG_LOSS, m, "seq-mean-token-sum-norm", num_seqs=5, max_len=10), 0.3)  # 1.5/5


def test_aggregate_loss_unknown_mode():
    with pytest.raises(ValueError):
        alg.aggregate_loss(AGG_LOSS, MASK_2x4, "mean")


# ================================================================== masked_whiten / count_uniform_groups


def test_masked_whiten_by_hand():
    x = t([[1.0, 2.0, 50.0], [3.0, 50.0, 50.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # valid [1, 2, 3]: mean 2, population var 2/3
    s = math.sqrt(2 / 3 + 1e-8)
    close(alg.masked_whiten(x, mask), [[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]])


def test_count_uniform_groups():
    rewards = t([1, 1, 0, 1, 2, 2, 0, 0])
    assert alg.count_uniform_groups(rewards, 2) == 3  # [1,1] [2,2] [0,0]
    assert alg.count_uniform_groups(rewards, 4) == 0  # [1,1,0,1] [2,2,0,0]
    assert alg.count_uniform_groups(t([0.5] * 8), 4) == 2
    assert alg.count_uniform_groups(t([0.0, 1.0, 1.0]), 3) == 0
    with pytest.raises(ValueError):
        alg.count_uniform_groups(rewards, 3)


# ================================================================== properties on random batches

SEEDS = [0, 1, 2, 3, 4]


def random_batch(seed: int, n_groups: int = 4, group_size: int = 4, width: int = 9):
    g = torch.Generator().manual_seed(seed)
    B = n_groups * group_size
    lengths = torch.randint(1, width + 1, (B,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(F64)
    rewards = torch.randn(B, generator=g, dtype=F64)
    values = torch.randn(B, width, generator=g, dtype=F64) * mask
    kl = torch.rand(B, width, generator=g, dtype=F64) * 0.1 * mask
    return rewards, mask, values, kl


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_groups_are_standardized(seed):
    rewards, mask, _, _ = random_batch(seed)
    adv, _ = alg.grpo(rewards, mask, group_size=4)
    per_seq = adv[:, 0].view(-1, 4)  # every row has a first valid token
    for group in per_seq.tolist():
        mean = sum(group) / 4
        std = math.sqrt(sum((a - mean) ** 2 for a in group) / 3)  # unbiased, as implemented
        assert mean == pytest.approx(0.0, abs=1e-9)
        assert std == pytest.approx(1.0, abs=1e-4)  # eps=1e-6 in the denominator
    # every valid token of a sequence carries the sequence's score
    close(adv, adv[:, :1] * mask, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_advantages_are_whitened(seed):
    rewards, mask, _, kl = random_batch(seed)
    for fn, kw in [(alg.reinforce_pp, {}), (alg.reinforce_pp_baseline, {"group_size": 4})]:
        adv, _ = fn(rewards, mask, kl_penalty=kl, gamma=0.9, **kw)
        vals = flat_valid(adv, mask)
        mean = sum(vals) / len(vals)
        pop_std = math.sqrt(sum((a - mean) ** 2 for a in vals) / len(vals))
        assert mean == pytest.approx(0.0, abs=1e-9)
        assert pop_std == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_returns_match_loop(seed):
    # Independent per-row loop: G_t = r_t + gamma * G_{t+1}, reward added on the last valid token.
    rewards, mask, _, kl = random_batch(seed)
    gamma = 0.9
    _, ret = alg.reinforce_pp(rewards, mask, kl_penalty=kl, gamma=gamma)
    for b in range(len(rewards)):
        n = int(mask[b].sum())
        r = [-float(kl[b, i]) for i in range(n)]
        r[-1] += float(rewards[b])
        g, expected = 0.0, [0.0] * n
        for i in reversed(range(n)):
            g = r[i] + gamma * g
            expected[i] = g
        close(ret[b, :n], expected, atol=1e-10)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_loop(seed):
    # Independent per-row loop over floats (Schulman et al. 2016), V after the last valid token = 0.
    rewards, mask, values, kl = random_batch(seed)
    gamma, lam = 0.95, 0.9
    adv, ret = alg.gae(rewards, mask, values=values, kl_penalty=kl, gamma=gamma, lam=lam, normalize=False)
    for b in range(len(rewards)):
        n = int(mask[b].sum())
        v = [float(values[b, i]) for i in range(n)] + [0.0]
        r = [-float(kl[b, i]) for i in range(n)]
        r[-1] += float(rewards[b])
        a, expected = 0.0, [0.0] * n
        for i in reversed(range(n)):
            a = r[i] + gamma * v[i + 1] - v[i] + gamma * lam * a
            expected[i] = a
        close(adv[b, :n], expected, atol=1e-10)
        close(ret[b, :n], [e + vi for e, vi in zip(expected, v)], atol=1e-10)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_baseline_excludes_the_sample(seed):
    rewards, mask, _, _ = random_batch(seed, n_groups=2, group_size=4)
    n, i, delta = 4, 5, 0.75  # sample 5 is the 2nd member of group 1 (rows 4..7)
    before, _ = alg.rloo(rewards, mask, group_size=n)
    bumped = rewards.clone()
    bumped[i] += delta
    after, _ = alg.rloo(bumped, mask, group_size=n)
    change = (after - before)[:, 0].tolist()
    expected = [0.0] * 4 + [-delta / (n - 1)] * 4
    expected[i] = delta
    assert change == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_and_rloo_relation(seed):
    # RLOO advantage = n/(n-1) * (r - group mean) = n/(n-1) * Dr.GRPO advantage.
    rewards, mask, _, _ = random_batch(seed)
    rl, _ = alg.rloo(rewards, mask, group_size=4)
    dr, _ = alg.dr_grpo(rewards, mask, group_size=4)
    close(rl, dr * 4 / 3, atol=1e-12)


def pad_with_garbage(x: torch.Tensor, mask: torch.Tensor, extra: int, seed: int) -> torch.Tensor:
    """x widened by `extra` columns, with large random garbage at every position where mask is 0."""
    g = torch.Generator().manual_seed(seed)
    wide_mask = torch.nn.functional.pad(mask, (0, extra))
    garbage = torch.randn(wide_mask.shape, generator=g, dtype=F64) * 50
    wide = torch.nn.functional.pad(x, (0, extra))
    return torch.where(wide_mask.bool(), wide, garbage)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(alg.ADVANTAGE_ESTIMATORS) + ["gae_unnormalized"])
def test_estimators_ignore_padding(name, seed):
    rewards, mask, values, kl = random_batch(seed)
    extra = 3
    wide_mask = torch.nn.functional.pad(mask, (0, extra))
    fn = alg.ADVANTAGE_ESTIMATORS["gae" if name == "gae_unnormalized" else name]
    kw = dict(group_size=4, gamma=0.9, lam=0.8, normalize=name != "gae_unnormalized")
    takes_kl = fn.__name__ in alg.KL_IN_REWARD_ESTIMATORS
    # on-policy distillation: per-token log-probs of the student and the teacher, and a reward term
    logps = {"student_logp": values, "teacher_logp": values.flip(0)} if name == "on_policy_distill" else {}
    distill = {"reward_coef": 0.5, "reward_estimator": "reinforce_pp"} if logps else {}
    base = fn(rewards, mask, values=values, kl_penalty=kl if takes_kl else None, **logps, **distill, **kw)
    wide = fn(
        rewards,
        wide_mask,
        values=pad_with_garbage(values, mask, extra, seed + 100),
        kl_penalty=pad_with_garbage(kl, mask, extra, seed + 200) if takes_kl else None,
        **{k: pad_with_garbage(v, mask, extra, seed + 300 + i) for i, (k, v) in enumerate(logps.items())},
        **distill,
        **kw,
    )
    for b, w in zip(base, wide):  # advantages, returns
        close(w[:, : mask.shape[1]], b, atol=1e-10)
        assert (w[wide_mask == 0] == 0).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", alg.LOSS_AGG_MODES)
def test_aggregation_ignores_padding(mode, seed):
    # max_len is the generation budget: a constant, so it is passed explicitly (the default is the width).
    _, mask, values, _ = random_batch(seed)
    extra = 3
    base = alg.aggregate_loss(values, mask, mode, max_len=16)
    wide = alg.aggregate_loss(
        pad_with_garbage(values, mask, extra, seed), torch.nn.functional.pad(mask, (0, extra)), mode, max_len=16
    )
    close(wide, base, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_losses_ignore_padding_through_aggregation(seed):
    # Garbage logp/old_logp/advantages on padding change neither the loss nor its gradient on valid tokens.
    _, mask, values, _ = random_batch(seed)
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=g, dtype=F64) * mask
    logp0 = old + 0.3 * torch.randn(mask.shape, generator=g, dtype=F64) * mask
    junk = lambda x, s: torch.where(mask.bool(), x, torch.randn(x.shape, generator=g, dtype=F64) * s)  # noqa: E731
    for mode in alg.LOSS_AGG_MODES:
        results = []
        for lp, op, adv in [(logp0, old, values), (junk(logp0, 3), junk(old, 3), junk(values, 50))]:
            lp = lp.clone().requires_grad_(True)
            loss, _ = alg.ppo_policy_loss(lp, op, adv, clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=3.0)
            total = alg.aggregate_loss(loss, mask, mode)
            total.backward()
            results.append((total.detach(), lp.grad * mask))
        close(results[1][0], results[0][0], atol=1e-12)
        close(results[1][1], results[0][1], atol=1e-12)


# ================================================================== gradient accumulation

LENGTHS = [7, 1, 4, 6, 2, 5, 3, 7]
MAX_LEN = 10  # generation budget, the constant divisor of seq-mean-token-sum-norm


def accumulation_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    mask = (torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]).to(F64)
    old = -torch.rand(8, width, generator=g, dtype=F64)
    logp = old + 0.3 * torch.randn(8, width, generator=g, dtype=F64)  # ratios spread past the clip range
    adv = torch.randn(8, width, generator=g, dtype=F64)
    return logp, old, adv, mask


def loss_and_grad(logp, old, adv, mask, mode, micro: int | None):
    leaf = logp.clone().requires_grad_(True)
    if micro is None:
        loss, _ = alg.ppo_policy_loss(leaf, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=3.0)
        total = alg.aggregate_loss(loss, mask, mode, max_len=MAX_LEN)
    else:
        total = torch.zeros((), dtype=F64)
        for s in range(0, 8, micro):
            rows = slice(s, s + micro)
            w = int(mask[rows].sum(-1).max())  # each micro-batch trimmed to its own width
            loss, _ = alg.ppo_policy_loss(
                leaf[rows, :w], old[rows, :w], adv[rows, :w], clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=3.0
            )
            total = total + alg.aggregate_loss(
                loss, mask[rows, :w], mode, num_tokens=mask.sum(), num_seqs=mask.shape[0], max_len=MAX_LEN
            )
    total.backward()
    return total.detach(), leaf.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", alg.LOSS_AGG_MODES)
def test_gradient_accumulation_invariance(mode, seed):
    logp, old, adv, mask = accumulation_batch(seed)
    whole_loss, whole_grad = loss_and_grad(logp, old, adv, mask, mode, None)
    assert whole_grad.abs().sum() > 0
    for micro in (1, 2, 4):
        loss, grad = loss_and_grad(logp, old, adv, mask, mode, micro)
        close(loss, whole_loss, atol=1e-10)
        close(grad, whole_grad, atol=1e-10)


def test_accumulation_needs_the_global_counts():
    # Sanity check that the invariance test is sensitive: local token counts give another gradient.
    logp, old, adv, mask = accumulation_batch(0)
    _, whole_grad = loss_and_grad(logp, old, adv, mask, "token-mean", None)
    leaf = logp.clone().requires_grad_(True)
    total = sum(
        alg.aggregate_loss(
            alg.ppo_policy_loss(
                leaf[s : s + 2], old[s : s + 2], adv[s : s + 2], clip_ratio_low=0.2, clip_ratio_high=0.28
            )[0],
            mask[s : s + 2],
            "token-mean",
        )
        for s in range(0, 8, 2)
    )
    total.backward()
    assert not torch.allclose(leaf.grad, whole_grad, atol=1e-6)


# ================================================================== global_sum over a split batch


def run_on_two_ranks(fn, inputs: list[dict]) -> list:
    """Run fn on two halves concurrently; global_sum adds the other half's local sum (an all-reduce)."""
    barrier = threading.Barrier(2, timeout=30)
    posted: list = [None, None]
    results: list = [None, None]
    errors: list = []

    def worker(rank: int):
        def global_sum(x):
            posted[rank] = x.clone()
            barrier.wait()
            out = x + posted[1 - rank]
            barrier.wait()  # nobody overwrites its slot before both have read
            return out

        try:
            results[rank] = fn(global_sum=global_sum, **inputs[rank])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


def halves(rewards, mask, values, kl, trim_second: bool = True):
    h = len(rewards) // 2
    w2 = int(mask[h:].sum(-1).max()) if trim_second else mask.shape[1]
    return [
        dict(rewards=rewards[:h], mask=mask[:h], values=values[:h], kl_penalty=kl[:h]),
        dict(rewards=rewards[h:], mask=mask[h:, :w2], values=values[h:, :w2], kl_penalty=kl[h:, :w2]),
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_whiten_global_sum(seed):
    _, mask, values, _ = random_batch(seed)
    whole = alg.masked_whiten(values, mask)
    h = mask.shape[0] // 2
    parts = run_on_two_ranks(
        lambda global_sum, x, m: alg.masked_whiten(x, m, global_sum),
        [dict(x=values[:h], m=mask[:h]), dict(x=values[h:], m=mask[h:])],
    )
    close(parts[0], whole[:h], atol=1e-10)
    close(parts[1], whole[h:], atol=1e-10)
    # and the halves alone really differ from the whole (the global statistics matter)
    assert not torch.allclose(alg.masked_whiten(values[:h], mask[:h]), whole[:h], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_estimators_global_sum(name, seed):
    rewards, mask, values, kl = random_batch(seed)
    fn = alg.ADVANTAGE_ESTIMATORS[name]
    kw = dict(group_size=4, gamma=0.9, lam=0.8, normalize=True)
    whole = fn(rewards, mask, values=values, kl_penalty=kl, **kw)
    parts = run_on_two_ranks(
        lambda global_sum, **inp: fn(global_sum=global_sum, **inp, **kw), halves(rewards, mask, values, kl)
    )
    h = mask.shape[0] // 2
    for k in range(2):  # advantages, returns
        close(parts[0][k], whole[k][:h], atol=1e-10)
        close(parts[1][k], whole[k][h:, : parts[1][k].shape[1]], atol=1e-10)


# ================================================================== policy-loss modes (issue 15)


def test_policy_loss_registry():
    assert set(alg.POLICY_LOSSES) == {"ppo", "gspo", "cispo"}
    assert alg.POLICY_LOSSES["ppo"] is alg.ppo_policy_loss


# Three sequences, width 3. Log-ratios log(pi/pi_old) on valid tokens:
#   row 0: [ln 2, ln 0.5]           A = -1   mean log-ratio 0      -> s = 1
#   row 1: [ln 4, 0]                A = +1   mean ln 2             -> s = 2
#   row 2: [ln 0.5, ln 0.5, ln 0.5] A = +1   mean ln 0.5           -> s = 0.5
GSPO_MASK = t([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
GSPO_LOG_RATIOS = [[math.log(2.0), math.log(0.5), 7.0], [math.log(4.0), 0.0, -9.0], [math.log(0.5)] * 3]
GSPO_ADVS = t([[-1.0, -1.0, 5.0], [1.0, 1.0, 5.0], [1.0, 1.0, 1.0]])  # 5.0 sits on padding


def gspo_inputs():
    old = t([[-1.0, -0.3, -2.0], [-2.5, -0.1, -1.0], [-0.4, -1.1, -0.9]])
    logp = (old + t(GSPO_LOG_RATIOS)).requires_grad_(True)
    return logp, old


def test_gspo_loss_and_gradient_by_hand():
    # clip 0.2 / 0.28 -> [0.8, 1.28]; loss_t = max(-A s, -A clip(s)), one s per sequence:
    #   row 0: s = 1, A = -1: max(1, 1) = 1, not clipped (PPO would clip its ratio-0.5 token: per-token ratios
    #          do not matter, only their geometric mean)
    #   row 1: s = 2, A = +1: max(-2, -1.28) = -1.28, clipped (the whole sequence)
    #   row 2: s = 0.5, A = +1: max(-0.5, -0.8) = -0.5, not clipped
    # d loss_t / d logp_t = -A * s on unclipped sequences (token form: s_i * grad log pi_t), 0 on clipped ones.
    logp, old = gspo_inputs()
    loss, clip = alg.gspo_policy_loss(logp, old, GSPO_ADVS, GSPO_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close((loss * GSPO_MASK).detach(), [[1.0, 1.0, 0.0], [-1.28, -1.28, 0.0], [-0.5, -0.5, -0.5]])
    close(clip * GSPO_MASK, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    (loss * GSPO_MASK).sum().backward()
    close(logp.grad, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [-0.5, -0.5, -0.5]])


def test_gspo_gradient_is_the_sequence_objectives():
    # With seq-mean-token-mean aggregation the token form has the gradient of the sequence-level GSPO loss
    # -(1/B) sum_i A_i s_i(theta), s_i = exp(mean_t (logp - old)), here written directly (no clipping is
    # active at a wide clip range).
    logp, old = gspo_inputs()
    loss, clip = alg.gspo_policy_loss(logp, old, GSPO_ADVS, GSPO_MASK, clip_ratio_low=0.9, clip_ratio_high=9.0)
    assert float((clip * GSPO_MASK).sum()) == 0
    alg.aggregate_loss(loss, GSPO_MASK, "seq-mean-token-mean").backward()
    leaf = logp.detach().clone().requires_grad_(True)
    objective = 0.0
    for i in range(3):
        n = int(GSPO_MASK[i].sum())
        s_i = torch.exp((leaf[i, :n] - old[i, :n]).mean())
        objective = objective - float(GSPO_ADVS[i, 0]) * s_i / 3
    objective.backward()
    close(logp.grad, leaf.grad, atol=1e-12)
    # by hand, row 1: d/d logp_t of -(1/3) * s = -(1/3) * s * (1/2) with s = 2 -> -1/3 on each of its 2 tokens
    close(leaf.grad[1], [-1 / 3, -1 / 3, 0.0])


def test_gspo_ignores_padding():
    # Garbage on padding (log-ratio 7 and -9 above) changes no sequence's ratio: rows 0 and 1 alone give the same.
    logp, old = gspo_inputs()
    loss, _ = alg.gspo_policy_loss(logp, old, GSPO_ADVS, GSPO_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28)
    trimmed, _ = alg.gspo_policy_loss(
        logp[:2, :2], old[:2, :2], GSPO_ADVS[:2, :2], GSPO_MASK[:2, :2], clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    close(loss[:2, :2].detach(), trimmed.detach())


# CISPO: ratios [1.5, 0.5, 6.0, 1.0], advantages [1, -1, 2, -0.5], logp [-1, -2, -0.5, -3].
CISPO_RATIOS = [1.5, 0.5, 6.0, 1.0]


def cispo_inputs():
    logp = t([[-1.0, -2.0, -0.5, -3.0]]).requires_grad_(True)
    old = logp.detach() - t([[math.log(r) for r in CISPO_RATIOS]])
    return logp, old, t([[1.0, -1.0, 2.0, -0.5]])


def test_cispo_loss_and_gradient_by_hand():
    # MiniMax-M1 setting: no lower bound (low = 1 -> weight >= 0), cap 1 + 4 = 5.
    # weights sg(clip(r, 0, 5)) = [1.5, 0.5, 5.0, 1.0]; loss = -w * A * logp:
    #   [-1.5*1*(-1), -0.5*(-1)*(-2), -5*2*(-0.5), -1*(-0.5)*(-3)] = [1.5, -1.0, 5.0, -1.5]
    # gradient -w * A = [-1.5, 0.5, -10.0, 0.5]; the clip is active on token 2 only.
    logp, old, adv = cispo_inputs()
    loss, clip = alg.cispo_policy_loss(logp, old, adv, clip_ratio_low=1.0, clip_ratio_high=4.0)
    close(loss.detach(), [[1.5, -1.0, 5.0, -1.5]])
    close(clip, [[0.0, 0.0, 1.0, 0.0]])
    loss.sum().backward()
    close(logp.grad, [[-1.5, 0.5, -10.0, 0.5]])


def test_cispo_keeps_the_gradient_ppo_drops():
    # clip 0.2 / 0.28: weights clip(r, 0.8, 1.28) = [1.28, 0.8, 1.28, 1.0], clip active on tokens 0-2;
    # gradient -w * A = [-1.28, 0.8, -2.56, 0.5]. PPO gives tokens 0 and 2 (A > 0, r > 1.28) and token 1
    # (A < 0, r < 0.8) no gradient at all.
    logp, old, adv = cispo_inputs()
    loss, clip = alg.cispo_policy_loss(logp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(clip, [[1.0, 1.0, 1.0, 0.0]])
    loss.sum().backward()
    close(logp.grad, [[-1.28, 0.8, -2.56, 0.5]])
    ppo_logp = logp.detach().clone().requires_grad_(True)
    ppo_loss, _ = alg.ppo_policy_loss(ppo_logp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28)
    ppo_loss.sum().backward()
    close(ppo_logp.grad, [[0.0, 0.0, 0.0, 0.5]])


# ================================================================== rollout-mismatch correction (issue 15)

# rho = pi_old / pi_rollout on valid tokens: row 0 [3, 0.25, 1.5], row 1 [0.5, 1.2]; padding holds garbage.
RC_MASK = t([[1, 1, 1, 0], [1, 1, 0, 0]])
RC_RATIOS = [[3.0, 0.25, 1.5, 50.0], [0.5, 1.2, 1e-6, 80.0]]


def rc(mode, level, **kw):
    old = t([[-1.0, -2.0, -0.5, -0.1], [-0.7, -1.5, -3.0, -2.0]])
    rollout = old - t([[math.log(r) for r in row] for row in RC_RATIOS])
    weights, keep, stats = alg.rollout_correction(old, rollout, RC_MASK, mode=mode, level=level, **kw)
    return weights, keep, {k: float(v) for k, v in stats.items()}


def test_tis_token_by_hand():
    # min(rho, 2): [2, 0.25, 1.5 | 0.5, 1.2]; all kept; mean 5.45 / 5 = 1.09; rho = 3 truncated: 1 of 5 tokens
    weights, keep, stats = rc("tis", "token", tis_cap=2.0)
    close(weights, [[2.0, 0.25, 1.5, 0.0], [0.5, 1.2, 0.0, 0.0]])
    close(keep, RC_MASK)
    assert stats == pytest.approx(
        {"weight_mean": 1.09, "weight_max": 2.0, "masked_fraction": 0.0, "truncated_fraction": 0.2}
    )


def test_mis_token_by_hand():
    # keep rho in [0.4, 2]: 3 and 0.25 dropped, 1.5 | 0.5, 1.2 kept (weight rho); mean 3.2 / 3, 2 of 5 dropped
    weights, keep, stats = rc("mis", "token", mis_low=0.4, mis_high=2.0)
    close(weights, [[0.0, 0.0, 1.5, 0.0], [0.5, 1.2, 0.0, 0.0]])
    close(keep, [[0, 0, 1, 0], [1, 1, 0, 0]])
    assert stats == pytest.approx(
        {"weight_mean": 3.2 / 3, "weight_max": 1.5, "masked_fraction": 0.4, "truncated_fraction": 0.0}
    )


SEQ0 = (3.0 * 0.25 * 1.5) ** (1 / 3)  # geometric mean of row 0: 1.125^(1/3) = 1.0400
SEQ1 = (0.5 * 1.2) ** (1 / 2)  # row 1: sqrt(0.6) = 0.7746


def test_tis_sequence_by_hand():
    # one ratio per sequence, truncated at 1: row 0 -> 1.0 (its 3 tokens truncated), row 1 stays 0.7746;
    # mean (3*1 + 2*0.7746)/5
    weights, keep, stats = rc("tis", "sequence", tis_cap=1.0)
    close(weights, [[1.0, 1.0, 1.0, 0.0], [SEQ1, SEQ1, 0.0, 0.0]])
    close(keep, RC_MASK)
    assert stats == pytest.approx(
        {"weight_mean": (3 + 2 * SEQ1) / 5, "weight_max": 1.0, "masked_fraction": 0.0, "truncated_fraction": 0.6}
    )
    # uncapped (cap 2) both geometric means pass through
    weights, _, _ = rc("tis", "sequence", tis_cap=2.0)
    close(weights, [[SEQ0, SEQ0, SEQ0, 0.0], [SEQ1, SEQ1, 0.0, 0.0]])


def test_mis_sequence_by_hand():
    # band [0.8, 1.25]: row 0 (1.0400) kept whole, row 1 (0.7746) dropped whole: 2 of 5 tokens
    weights, keep, stats = rc("mis", "sequence", mis_low=0.8, mis_high=1.25)
    close(weights, [[SEQ0, SEQ0, SEQ0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    close(keep, [[1, 1, 1, 0], [0, 0, 0, 0]])
    assert stats == pytest.approx(
        {"weight_mean": SEQ0, "weight_max": SEQ0, "masked_fraction": 0.4, "truncated_fraction": 0.0}
    )


def test_rollout_correction_none_and_errors():
    weights, keep, stats = rc("none", "token")
    close(weights, RC_MASK)
    close(keep, RC_MASK)
    assert stats == pytest.approx(
        {"weight_mean": 1.0, "weight_max": 1.0, "masked_fraction": 0.0, "truncated_fraction": 0.0}
    )
    with pytest.raises(ValueError, match="mode"):
        rc("icepop", "token")
    with pytest.raises(ValueError, match="level"):
        rc("tis", "geometric")


# ================================================================== DAPO overlong shaping (issue 15)


def test_overlong_penalty_by_hand():
    # L_max = 20, buffer 4: free up to 16 tokens, then (16 - L)/4 * factor, -factor at 20 and beyond.
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    close(
        alg.overlong_penalty(lengths, max_response_tokens=20, buffer_tokens=4, penalty_factor=1.0),
        [0.0, 0.0, -0.25, -0.5, -1.0, -1.0],
    )
    close(
        alg.overlong_penalty(lengths, max_response_tokens=20, buffer_tokens=4, penalty_factor=0.5),
        [0.0, 0.0, -0.125, -0.25, -0.5, -0.5],
    )


# ================================================================== accumulation invariance of the new modes

CORRECTIONS = {
    "none": None,
    "tis-token": dict(mode="tis", level="token", tis_cap=1.2),
    "tis-sequence": dict(mode="tis", level="sequence", tis_cap=1.05),
    "mis-token": dict(mode="mis", level="token", mis_low=0.8, mis_high=1.25),
    "mis-sequence": dict(mode="mis", level="sequence", mis_low=0.95, mis_high=1.05),
}
LOSS_CLIP = {
    "ppo": dict(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=3.0),
    "gspo": dict(clip_ratio_low=0.03, clip_ratio_high=0.04),
    "cispo": dict(clip_ratio_low=1.0, clip_ratio_high=0.28),
}


def corrected_loss_and_grad(name, correction, mode, micro: int | None, seed: int = 0):
    """Loss and gradient of one mini-batch of 8 with a policy-loss mode and a rollout correction, whole or in
    micro-batches whose aggregation uses the mini-batch's kept-token count (as PPOModule does)."""
    logp, old, adv, mask = accumulation_batch(seed)
    rollout = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=F64)
    weights, keep = mask, mask
    if correction is not None:  # once for the whole rollout batch, as make_experience does
        weights, keep, _ = alg.rollout_correction(old, rollout, mask, **correction)
    fn = alg.POLICY_LOSSES[name]
    leaf = logp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for s in range(0, 8, micro or 8):
        rows = slice(s, s + (micro or 8))
        w = int(mask[rows].sum(-1).max())
        loss, _ = fn(leaf[rows, :w], old[rows, :w], adv[rows, :w], mask[rows, :w], **LOSS_CLIP[name])
        total = total + alg.aggregate_loss(
            loss * weights[rows, :w], keep[rows, :w], mode, num_tokens=keep.sum(), num_seqs=8, max_len=MAX_LEN
        )
    total.backward()
    return total.detach(), leaf.grad, keep


@pytest.mark.parametrize("correction", list(CORRECTIONS))
@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("mode", alg.LOSS_AGG_MODES)
def test_new_modes_gradient_accumulation_invariance(name, correction, mode):
    whole_loss, whole_grad, keep = corrected_loss_and_grad(name, CORRECTIONS[correction], mode, None)
    assert whole_grad.abs().sum() > 0
    if correction.startswith("mis"):  # the band really drops some tokens, and keeps some
        assert 0 < float(keep.sum()) < float(accumulation_batch(0)[3].sum())
    for micro in (1, 2, 4):
        loss, grad, _ = corrected_loss_and_grad(name, CORRECTIONS[correction], mode, micro)
        close(loss, whole_loss, atol=1e-10)
        close(grad, whole_grad, atol=1e-10)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_new_modes_clip_in_the_accumulation_batch(name):
    """The invariance test above covers clipped and unclipped tokens for GSPO and CISPO."""
    logp, old, adv, mask = accumulation_batch(0)
    _, clip = alg.POLICY_LOSSES[name](logp, old, adv, mask, **LOSS_CLIP[name])
    clipped = float((clip * mask).sum())
    assert 0 < clipped < float(mask.sum())


@pytest.mark.parametrize("correction", [c for c in CORRECTIONS if c != "none"])
def test_rollout_correction_is_per_row(correction):
    """Computed on micro-batches (or a rank's rows) it gives the whole batch's rows: each row stands alone."""
    _, old, _, mask = accumulation_batch(1)
    rollout = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(8), dtype=F64)
    weights, keep, _ = alg.rollout_correction(old, rollout, mask, **CORRECTIONS[correction])
    for s in range(0, 8, 2):
        w = int(mask[s : s + 2].sum(-1).max())
        part_w, part_k, _ = alg.rollout_correction(
            old[s : s + 2, :w], rollout[s : s + 2, :w], mask[s : s + 2, :w], **CORRECTIONS[correction]
        )
        close(part_w, weights[s : s + 2, :w], atol=1e-12)
        close(part_k, keep[s : s + 2, :w], atol=0)


@pytest.mark.parametrize("correction", [c for c in CORRECTIONS if c != "none"])
def test_rollout_correction_stats_global_sum(correction):
    _, old, _, mask = accumulation_batch(2)
    rollout = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    _, _, whole = alg.rollout_correction(old, rollout, mask, **CORRECTIONS[correction])

    def on_rank(global_sum, o, r, m):
        # the max over ranks through the same exchange: the larger of the two posted values
        return alg.rollout_correction(
            o,
            r,
            m,
            **CORRECTIONS[correction],
            global_sum=global_sum,
            global_max=lambda x: torch.maximum(x, global_sum(x) - x),
        )[2]

    parts = run_on_two_ranks(
        on_rank, [dict(o=old[:4], r=rollout[:4], m=mask[:4]), dict(o=old[4:], r=rollout[4:], m=mask[4:])]
    )
    for stats in parts:
        for k in whole:
            close(stats[k], whole[k], atol=1e-12)
