"""Rollout-mismatch correction and the policy-loss modes inside the real PPO loop (vLLM engine, Lightning)."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import pytest
import torch

from lit_ppo.config import RolloutConfig, RolloutCorrectionConfig
from tests.helpers import build_run


def varied_reward(prompts, responses, references, extras):
    """A reward that differs between the samples of a prompt (a hash of the response), so GRPO has advantages even
    for the untrained fixture model."""
    return [int.from_bytes(hashlib.sha256(r.encode()).digest()[:4], "little") / 2**32 for r in responses]


def grpo_run(paths, engine, tmp_path, **settings):
    """build_run's one rollout step of GRPO without KL (in the loss, coefficient 0) on the fixture model and the
    arithmetic prompts (`paths`); `settings`: build_run's keywords on top."""
    return build_run(
        paths[0], engine, paths[1], tmp_path, advantage_estimator="grpo", kl_coef=0.0, kl_mode="loss", **settings
    )


def one_step(paths, engine, tmp_path, *, shift: float, **ppo):
    """One rollout step of GRPO without KL whose vLLM log-probs are moved by `shift` nats on every token, as a
    sampler that disagrees with the trainer would report them: rho = pi_old / pi_rollout = exp(-shift)."""
    # A sampler 1 nat off on every token would stop the run at rollout.max_logprob_abs_diff (the gate against
    # stale weights); this test simulates one on purpose, so the gate is off.
    rollout = RolloutConfig(max_response_tokens=6, eval_samples_per_prompt=2, max_logprob_abs_diff=None)
    trainer, module, datamodule, _ = grpo_run(paths, engine, tmp_path, reward_fn=varied_reward, rollout=rollout, **ppo)
    produce = datamodule.produce_rollout

    def shifted(step):
        batch = produce(step)
        return dataclasses.replace(batch, rollout_logprobs=[[x + shift for x in row] for row in batch.rollout_logprobs])

    datamodule.produce_rollout = shifted
    before = {k: v.clone() for k, v in module.actor.state_dict().items()}
    trainer.fit(module, datamodule=datamodule)
    changed = any(not torch.equal(before[k], v) for k, v in module.actor.state_dict().items())
    return module.history[-1], changed


@pytest.fixture
def paths(tiny_model_dir, arithmetic_files):
    return tiny_model_dir, arithmetic_files


def test_tis_weights_reach_the_loss_and_the_metrics(paths, engine, tmp_path):
    # rho = exp(-1) = 0.368 on every token (plus the tiny float32 vLLM-vs-trainer difference), below the cap of 2.
    row, changed = one_step(
        paths,
        engine,
        tmp_path,
        shift=1.0,
        rollout_correction=RolloutCorrectionConfig(mode="tis", level="token", tis_cap=2.0),
    )
    assert row["rollout_correction/weight_mean"] == pytest.approx(math.exp(-1.0), rel=1e-3)
    assert row["rollout_correction/weight_max"] == pytest.approx(math.exp(-1.0), rel=1e-3)
    assert row["rollout_correction/masked_fraction"] == 0.0
    assert row["rollout_correction/truncated_fraction"] == 0.0  # every rho below the cap
    assert changed


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_drops_tokens_from_the_policy_loss(paths, engine, tmp_path, level):
    # rho = 0.368 is below mis_low = 0.5 everywhere: every token leaves the loss, so the actor cannot move
    # (no KL, no entropy bonus). With mode=none the same step moves it.
    mis = RolloutCorrectionConfig(mode="mis", level=level, mis_low=0.5, mis_high=2.0)
    row, changed = one_step(paths, engine, tmp_path / "mis", shift=1.0, rollout_correction=mis)
    assert row["rollout_correction/masked_fraction"] == 1.0
    assert not changed
    row, changed = one_step(paths, engine, tmp_path / "none", shift=1.0)
    assert "rollout_correction/masked_fraction" not in row
    assert changed


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_the_configured_policy_loss_is_the_one_trained_with(paths, engine, tmp_path, monkeypatch, policy_loss):
    from lit_ppo import algorithms as alg

    calls = []
    real = alg.POLICY_LOSSES[policy_loss]
    monkeypatch.setitem(alg.POLICY_LOSSES, policy_loss, lambda *a, **k: calls.append(1) or real(*a, **k))
    clip = {
        "gspo": {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
        "cispo": {"clip_ratio_low": 1.0, "clip_ratio_high": 4.0},
    }[policy_loss]
    trainer, module, datamodule, _ = grpo_run(paths, engine, tmp_path, policy_loss=policy_loss, **clip)
    trainer.fit(module, datamodule=datamodule)
    assert len(calls) == 8  # 32 samples in micro-batches of 4: every micro-batch's loss
