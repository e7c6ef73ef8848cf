"""On-policy distillation (`ppo=distill`) where the student's samples come from elsewhere than one process's engine:
2 DDP ranks (gloo on CPU) against the same run in one process, and a rollout worker at k = 1
(`rollout.mode=disaggregated`). The teacher is the shared fixture model (the tiny model's tokenizer, another shape and
other weights than the warm-started student). Each run takes 40-80 s on 2 shared cores: slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.cli_runs import DDP, assert_same_weights, experience, final_actor, metrics, train_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def distill(tiny_model_dir) -> list[str]:
    return ["ppo=distill", f"model.teacher.path={tiny_model_dir}"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache, distill) -> Path:
    return train_cli(tmp_path_factory.mktemp("distill_single"), cache, *distill)


def test_two_ddp_ranks_distill_as_one_process(single, tmp_path, cache, distill):
    """The same samples, the same teacher advantages (each rank's teacher forwards of its share) and the same final
    weights as the one-process run; the teacher's metrics, global, the same."""
    ddp = train_cli(tmp_path / "ddp", cache, *distill, *DDP)
    for step in range(2):
        one, two = experience(single, step, world=1), experience(ddp, step, world=2)
        assert two["response_ids"] == one["response_ids"]
        torch.testing.assert_close(two["advantages"], one["advantages"], rtol=0, atol=1e-5)
        assert one["advantages"].abs().max() > 0.01
    assert_same_weights(final_actor(ddp), final_actor(single))
    for a, b in zip(metrics(ddp), metrics(single)):
        assert float(a["teacher/reverse_kl"]) == pytest.approx(float(b["teacher/reverse_kl"]), abs=1e-5)
        assert float(a["teacher/logprob_gap"]) == pytest.approx(float(b["teacher/logprob_gap"]), abs=1e-5)


def test_a_rollout_worker_at_k1_distills(tmp_path, cache, distill):
    """Samples of the policy one version old (k = 1) scored by the teacher in the trainer: every step has the teacher's
    metrics and non-zero advantages, and the lag the plan states."""
    run = train_cli(tmp_path / "k1", cache, *distill, "rollout.mode=disaggregated", "rollout.max_staleness=1")
    rows = metrics(run)
    assert [float(r["rollout/policy_version_lag"]) for r in rows] == [0.0, 1.0]
    assert all(float(r["teacher/logprob_gap"]) > 0.01 for r in rows)
    for step in range(2):
        assert experience(run, step, world=1)["advantages"].abs().max() > 0.01
