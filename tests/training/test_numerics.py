"""Long-context numerics (issue 51 item 4): the sampler's log-probs against the trainer's by depth and the share of
tokens outside [0.9, 1.1] (pure functions against plain loops, then in a real rollout step), and the PPO ratio of the
first mini-batch of the first epoch, exactly 1 in every layout and precision."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lit_ppo.plan import compute_plan
from lit_ppo.testing import synthetic_rollout_batch
from lit_ppo.training import numerics
from lit_ppo.training.batching import pack
from lit_ppo.training.module import PPOModule
from lit_ppo.training.numerics import (
    DEPTH_EDGES,
    depth_bin_names,
    depth_binned_sums,
    ratio_outside_count,
    sampler_mismatch_metrics,
    token_depths,
)
from tests.helpers import ppo_at, run_config
from tests.helpers.fixed_batch import train_on_fixed_batch
from tests.helpers.packing import realistic_rollout

TEMPERATURE = 0.7


def test_depth_bins_are_named_by_their_bounds():
    assert depth_bin_names() == [
        "rollout/logprob_abs_diff_depth_0-512",
        "rollout/logprob_abs_diff_depth_512-2k",
        "rollout/logprob_abs_diff_depth_2k-8k",
        "rollout/logprob_abs_diff_depth_8k-32k",
        "rollout/logprob_abs_diff_depth_32k+",
    ]
    assert depth_bin_names((0, 100, 1536)) == [
        "rollout/logprob_abs_diff_depth_0-100",
        "rollout/logprob_abs_diff_depth_100-1536",
        "rollout/logprob_abs_diff_depth_1536+",
    ]


def test_binned_sums_and_the_band_count_equal_a_plain_loop():
    """Prompts of 100 to 60k tokens, so every bin holds tokens, edges hit exactly (511, 512, 2047, 2048, ...)."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.tensor([100, 505, 2040, 8000, 32760, 60000])
    T = 12
    diff = torch.randn(len(prompts), T, generator=g)  # trainer - sampler
    mask = (torch.rand(len(prompts), T, generator=g) > 0.2).float()
    depth = token_depths(prompts, T)
    sums, counts = depth_binned_sums(diff.abs(), mask, depth)
    outside = ratio_outside_count(diff * 0.1, mask)
    loop_sums, loop_counts, loop_outside = [0.0] * 5, [0.0] * 5, 0.0
    for i in range(len(prompts)):
        for t in range(T):
            if mask[i, t] == 0:
                continue
            d = int(prompts[i]) + t
            k = max(j for j, edge in enumerate(DEPTH_EDGES) if d >= edge)
            loop_sums[k] += abs(float(diff[i, t]))
            loop_counts[k] += 1
            ratio = math.exp(float(diff[i, t]) * 0.1)
            loop_outside += not (0.9 <= ratio <= 1.1)
    assert counts.tolist() == loop_counts and all(c > 0 for c in loop_counts)
    assert sums.tolist() == pytest.approx(loop_sums, rel=1e-12)
    assert float(outside) == loop_outside and 0 < loop_outside < mask.sum()


def test_mismatch_metrics_leave_out_empty_bins_and_count_the_band_hand_case():
    # Two samples, prompts of 510 and 100 tokens, 4 response columns (sample 1's last is padding):
    #   sample 0 depths 510 511 | 512 513: |diff| 0.01 0.01 | 0.2 0.2   -> bin 0-512: 0.01, bin 512-2k: 0.2
    #   sample 1 depths 100 101 102: |diff| 0.05 0.05 0.05                 -> bin 0-512
    trainer = torch.zeros(2, 4)
    sampler = torch.tensor([[0.01, -0.01, 0.2, -0.2], [0.05, 0.05, -0.05, 9.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    row = sampler_mismatch_metrics(trainer, sampler, mask, torch.tensor([510, 100]), global_sum=lambda x: x)
    assert row.keys() == {
        "rollout/logprob_abs_diff_depth_0-512",
        "rollout/logprob_abs_diff_depth_512-2k",
        "rollout/ratio_outside_band_fraction",
    }
    assert row["rollout/logprob_abs_diff_depth_0-512"] == pytest.approx((0.01 * 2 + 0.05 * 3) / 5)
    assert row["rollout/logprob_abs_diff_depth_512-2k"] == pytest.approx(0.2)
    # exp(-0.2) = 0.82 and exp(0.2) = 1.22 leave [0.9, 1.1]; exp(+-0.05) and exp(+-0.01) stay; padding not counted
    assert row["rollout/ratio_outside_band_fraction"] == pytest.approx(2 / 7)


def test_the_numerics_count_only_the_tokens_of_the_batch_s_own_version():
    """review58 #5: a carried token of partial rollouts (an older version, early in its response) and a stale batch's
    (rollout workers at k > 0) differ from the trainer by the updates since their version: staleness, which would show
    as depth drift. Rollout step 3; prompts of 100 and 600 tokens, 4 response tokens each:
      sample 0 spans (0, v2), (2, v3): |diff| 0.5 0.5 (carried, depths 100 101) | 0.01 0.01 (depths 102 103)
      sample 1 spans (0, v3):          |diff| 0.02 x 4 (depths 600..603)"""
    from types import SimpleNamespace

    from lit_ppo.training.experience import sampler_numerics

    trainer = torch.zeros(2, 4)
    sampler = torch.tensor([[0.5, -0.5, 0.01, -0.01], [0.02, -0.02, 0.02, -0.02]])
    mask = torch.ones(2, 4)
    prompts = [[1] * 100, [1] * 600]
    carried = SimpleNamespace(
        rollout_step=3, prompt_ids=prompts, version_spans=[[[0, 2], [2, 3]], [[0, 3]]], policy_versions=[2, 3]
    )
    row = sampler_numerics(carried, trainer, sampler, mask)
    assert row == pytest.approx(
        {
            "rollout/logprob_abs_diff_depth_0-512": 0.01,  # not (0.5 x 2 + 0.01 x 2) / 4: the carried tokens left out
            "rollout/logprob_abs_diff_depth_512-2k": 0.02,
            "rollout/ratio_outside_band_fraction": 0.0,  # exp(+-0.5) would leave the band
        }
    )
    # Without spans: the samples of the step's own version (a refill round's); a stale batch has none, and logs none.
    refill = SimpleNamespace(rollout_step=3, prompt_ids=prompts, version_spans=None, policy_versions=[2, 3])
    assert sampler_numerics(refill, trainer, sampler, mask) == pytest.approx(
        {"rollout/logprob_abs_diff_depth_512-2k": 0.02, "rollout/ratio_outside_band_fraction": 0.0}
    )
    stale = SimpleNamespace(rollout_step=3, prompt_ids=prompts, version_spans=None, policy_versions=[2, 2])
    assert sampler_numerics(stale, trainer, sampler, mask) == {}
    colocated = SimpleNamespace(rollout_step=3, prompt_ids=prompts, version_spans=None, policy_versions=[3, 3])
    assert sampler_numerics(colocated, trainer, sampler, mask)["rollout/ratio_outside_band_fraction"] == 0.25


# ---------------------------------------------------------------- in a rollout step

LAYOUTS = {
    "padded": dict(packing=False),
    "packed": dict(packing=True, shared_prefix=False),
    "shared-prefix": dict(packing=True, shared_prefix=True),
}


def long_batch():
    """2 prompts of 200-400 tokens x 4 responses of 100-256: depths on both sides of 512."""
    batch = synthetic_rollout_batch(2, 4, (200, 400), (100, 256), seed=1)
    assert any(len(p) + len(r) > 560 for p, r in zip(batch.prompt_ids, batch.response_ids))
    return batch


def with_sampler_logprobs(model_dir, batch, ppo):
    """`batch` with sampler log-probs: the actor's own (float32, padded, temperature 0.7) minus 0.01 nats at depths
    below 512 and 0.2 nats at 512 and beyond (ratios 1.01 and 1.22: the deep tokens outside [0.9, 1.1])."""
    plan = compute_plan(run_config(ppo=ppo, rollout=realistic_rollout()), 2)
    module = PPOModule(model_dir=model_dir, ppo=ppo, plan=plan, pad_token_id=0, temperature=TEMPERATURE)
    with torch.no_grad():
        logp = module.response_logprobs(module.actor, pack(batch.prompt_ids, batch.response_ids, 0, "cpu"))
    sampler = []
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        shift = torch.tensor([0.01 if len(p) + t < 512 else 0.2 for t in range(len(r))])
        sampler.append((logp[i, : len(r)] - shift).tolist())
    return dataclasses.replace(batch, rollout_logprobs=sampler)


def experience_in_one_micro_batch(module: PPOModule) -> None:
    """The experience forwards of `module` in one micro-batch of all 8 samples (the training forwards: micro-batches of
    2): the old log-probs laid out unlike the training forward's."""
    make_experience = module.make_experience

    def one_group_layout(batch):
        layout = PPOModule.micro_batch_layout(module, batch)
        layout.split = lambda indices: [list(indices)]
        return layout

    def experience(batch):
        module.micro_batch_layout = one_group_layout
        try:
            return make_experience(batch)
        finally:
            del module.micro_batch_layout

    module.make_experience = experience


def one_step(model_dir, files, tmp_path, layout: str, precision: str):
    """One rollout step of GRPO on `long_batch` (8 samples, 2 mini-batches of 4 in micro-batches of 2: old log-probs
    from the experience forward, in one micro-batch of 8) in `layout` and `precision`; its metrics row and the batch."""
    ppo = ppo_at(2, 4, 4, 2, "grpo", actor_lr=1e-3, **LAYOUTS[layout])
    rollout = realistic_rollout()
    batch = with_sampler_logprobs(model_dir, long_batch(), ppo)
    module, _ = train_on_fixed_batch(
        model_dir,
        files[0],
        tmp_path,
        batch,
        ppo,
        rollout,
        lambda prompts: compute_plan(run_config(ppo=ppo, rollout=rollout, precision=precision), prompts),
        grads_of=None,
        prepare=experience_in_one_micro_batch,
        precision=precision,
        temperature=TEMPERATURE,
        max_logprob_abs_diff=None,
    )
    assert module.plan.old_logprobs.source == "experience forward"
    assert module.plan.layout.shared_prefix == (layout == "shared-prefix")
    return module.history[-1], batch


# One case in the default suite (each takes 15-100 s on a loaded 2-core machine; float32's exact ratio also in
# tests/run/test_report.py's run), the others slow.
CASES = [
    pytest.param("padded", "32-true", marks=pytest.mark.slow),
    pytest.param("padded", "bf16-mixed", marks=pytest.mark.slow),
    pytest.param("packed", "32-true", marks=pytest.mark.slow),
    pytest.param("packed", "bf16-mixed", marks=pytest.mark.slow),
    pytest.param("shared-prefix", "32-true", marks=pytest.mark.slow),
    pytest.param("shared-prefix", "bf16-mixed"),
]


@pytest.mark.parametrize("layout, precision", CASES)
def test_first_minibatch_ratio_is_exactly_one_in_every_layout_and_precision(
    tiny_model_dir, arithmetic_files, tmp_path, layout, precision
):
    """The loss's ratio on the first mini-batch of the first epoch is exactly 1 (max |ratio - 1| = 0.0) although the
    experience forward laid the samples out otherwise, whose old log-probs would not give 1 (measured:
    `actor/experience_ratio_first_minibatch_max_dev`, bf16's rounding of another batch shape). The sampler metrics
    read the depths the batch has."""
    row, batch = one_step(tiny_model_dir, arithmetic_files, tmp_path, layout, precision)
    print(layout, precision, {k: v for k, v in row.items() if "ratio" in k or "depth" in k})
    assert row["actor/ratio_first_minibatch_max_dev"] == 0.0
    experience_dev = row["actor/experience_ratio_first_minibatch_max_dev"]
    assert (experience_dev > 1e-5) if precision == "bf16-mixed" else (experience_dev < 1e-5)
    # The sampler 0.01 nats off below depth 512 and 0.2 from 512: the bins read those shifts.
    tol = 1e-4 if precision == "32-true" else 0.01
    assert row["rollout/logprob_abs_diff_depth_0-512"] == pytest.approx(0.01, abs=tol)
    assert row["rollout/logprob_abs_diff_depth_512-2k"] == pytest.approx(0.2, abs=tol)
    assert not any(k.startswith("rollout/logprob_abs_diff_depth_2k") for k in row)
    if precision == "32-true":  # the tokens at depth 512 and beyond leave [0.9, 1.1]
        deep = sum(max(0, len(p) + len(r) - max(512, len(p))) for p, r in zip(batch.prompt_ids, batch.response_ids))
        tokens = sum(len(r) for r in batch.response_ids)
        assert row["rollout/ratio_outside_band_fraction"] == pytest.approx(deep / tokens)


def test_the_ratio_check_fails_with_the_experience_forward_s_old_logprobs(
    tiny_model_dir, arithmetic_files, tmp_path, monkeypatch
):
    """Without the first mini-batch's own old log-probs (the experience forward's, laid out in one micro-batch of 8,
    instead) the bf16 ratio leaves 1: the test above can fail."""
    monkeypatch.setattr(numerics, "first_minibatch_old_logp", lambda inputs: inputs)
    row, _ = one_step(tiny_model_dir, arithmetic_files, tmp_path, "packed", "bf16-mixed")
    assert row["actor/ratio_first_minibatch_max_dev"] > 1e-5
    assert row["actor/ratio_first_minibatch_max_dev"] == row["actor/experience_ratio_first_minibatch_max_dev"]


def test_the_first_minibatch_ratio_is_measured_from_the_old_logprobs_the_loss_used(monkeypatch):
    """`actor/ratio_first_minibatch_max_dev` is max |exp(logp - old) - 1| over the response tokens with the old
    log-probs the loss divides by (`old_logprobs_used`): the forward's own where the inputs have none (0.0 exactly),
    the inputs' where they have them (the deviation measured, not assumed)."""
    from types import SimpleNamespace

    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    ratio = numerics.FirstMiniBatchRatio("training forward")
    ratio.add(logp, SimpleNamespace(old_logp=None, response_mask=mask))
    assert ratio.max_dev == 0.0
    ratio.add(logp, SimpleNamespace(old_logp=torch.tensor([[-1.0, -2.1, -9.0]]), response_mask=mask))
    assert ratio.max_dev == pytest.approx(
        math.exp(0.1) - 1, rel=1e-5
    )  # float32 inputs; the masked third token's 6 nats left out
    # the metric reads the loss's own definition (loss.actor_loss calls it too): old log-probs that moved are seen
    from lit_ppo.training import loss

    assert loss.old_logprobs_used is numerics.old_logprobs_used
    monkeypatch.setattr(numerics, "old_logprobs_used", lambda logp, inputs: logp.detach() - 0.2)
    moved = numerics.FirstMiniBatchRatio("training forward")
    moved.add(logp, SimpleNamespace(old_logp=None, response_mask=mask))
    assert moved.max_dev == pytest.approx(math.exp(0.2) - 1, rel=1e-5)
