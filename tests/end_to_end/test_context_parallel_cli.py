"""Context parallelism from the command line (issue 51): `python train.py strategy=ddp strategy.devices=2
strategy.context_parallel_size=2` on CPU (gloo) trains two rollout steps as one group of 2 ranks sharing every sample
and splitting each row's tokens, and ends with the one-rank run's weights (float32); the plan table shows C and the
tokens per rank. Two train.py runs of 2 rollout steps (minutes): `make test-slow`. The fast module-level test of the
same step is tests/training/test_context_parallel.py::test_a_rollout_step_on_two_context_parallel_ranks_trains_the_one_rank_step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.cli_runs import DDP, assert_same_weights, experience, final_actor, metrics, train_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, cache) -> Path:
    return train_cli(tmp_path_factory.mktemp("single"), cache)


@pytest.fixture(scope="module")
def context_parallel_run(tmp_path_factory, cache, single_run) -> Path:
    return train_cli(tmp_path_factory.mktemp("cp2"), cache, *DDP, "strategy.context_parallel_size=2")


def test_two_context_parallel_ranks_end_with_the_one_rank_weights(single_run, context_parallel_run):
    run = context_parallel_run
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["counts"]["data_parallel_size"], plan["counts"]["context_parallel_size"]) == (1, 2)
    assert plan["layout"]["sequence_length_divisor"] == 2
    assert plan["layout"]["tokens_per_rank_per_micro_batch"] * 2 >= plan["layout"]["max_micro_batch_tokens"]
    console = (run / "train.log").read_text()
    assert "context-parallel size                      2" in console and "tokens per rank" in console
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollout_steps"] == 2
    for step in range(2):  # one group: every sample once (its first rank's dump), the one-rank run's samples
        one, cp = experience(single_run, step, world=1), experience(run, step, world=1)
        assert cp["response_ids"] == one["response_ids"] and torch.equal(cp["rewards"], one["rewards"])
        width = one["mask"].shape[1]
        for key in ("advantages", "returns", "values"):
            torch.testing.assert_close(cp[key][:, :width], one[key], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
    for one, cp in zip(metrics(single_run), metrics(run), strict=True):
        for key in ("actor/policy_loss", "critic/value_loss", "actor/grad_norm", "perf/trained_tokens"):
            assert float(cp[key]) == pytest.approx(float(one[key]), rel=1e-4, abs=1e-8), key
    difference = assert_same_weights(final_actor(run), final_actor(single_run), rel=1e-5)
    print(f"final actor: largest difference {difference:.1e} of the largest weight")  # pytest -s


def resumed_from(run: Path, out: Path, cache: Path, *overrides: str) -> Path:
    """`run`'s directory as a requeued job finds it after rollout step 1 (its config.yaml and that checkpoint),
    continued with `resume=auto` under `overrides` (another C, another number of ranks)."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.yaml", out / "config.yaml")
    shutil.copy(run / "checkpoints" / "rollout_step_000001.ckpt", out / "checkpoints")
    return train_cli(out, cache, *overrides, "resume=auto")


@pytest.mark.parametrize("ranks, C", [(1, 1), (2, 1)], ids=["at-c1-on-1-rank", "at-c1-on-2-ranks"])
def test_a_c2_checkpoint_resumes_at_c1_as_the_run_at_c1_would_continue(
    tmp_path, cache, single_run, context_parallel_run, ranks, C
):
    """The C = 2 run's checkpoint after rollout step 1, resumed at C = 1 on 1 or 2 ranks: its second rollout step has
    the one-rank run's samples and data position (exactly: the seeds and the prompt stream are global), advantages,
    and the final actor within the C = 2 vs one-rank tolerance (the checkpoint's weights and optimizer states are the
    C = 2 run's, whole: equal to the one-rank run's to float32 summation order)."""
    run = resumed_from(
        context_parallel_run,
        tmp_path / "resumed",
        cache,
        "strategy=ddp",
        "strategy.accelerator=cpu",
        f"strategy.devices={ranks}",
        f"strategy.context_parallel_size={C}",
    )
    log = (run / "train.log").read_text()
    assert (
        f"resharded: the checkpoint of rollout step 1 was written by 2 rank(s) (C = 2) and continues on {ranks} (C = 1)"
        in log
    )
    assert [r["rollout_step"] for r in metrics(run)] == ["1", "2"]  # history carried, step 1 not trained again
    one, resumed = experience(single_run, 1, world=1), experience(run, 1, world=ranks)
    assert resumed["dataset_indices"] == one["dataset_indices"] and resumed["response_ids"] == one["response_ids"]
    torch.testing.assert_close(resumed["advantages"], one["advantages"], atol=1e-5, rtol=0)
    difference = assert_same_weights(final_actor(run), final_actor(single_run), rel=1e-5)
    print(f"resumed {ranks} rank(s) at C = {C}: largest difference {difference:.1e} of the largest weight")


def test_a_c1_checkpoint_of_two_ranks_resumes_at_c2_as_the_run_at_c2_would_continue(tmp_path, cache, single_run):
    """The reverse: a 2-rank run at C = 1 stopped after rollout step 1, resumed at C = 2 on the same 2 ranks (its
    rank 0 generating for the group, its rank 1 receiving): the second rollout step's samples and data position
    exactly the one-rank run's, the final actor within the C = 2 vs one-rank tolerance."""
    first = train_cli(tmp_path / "c1", cache, *DDP, "trainer.total_rollout_steps=1")
    run = resumed_from(
        first, tmp_path / "resumed", cache, *DDP, "strategy.context_parallel_size=2", "trainer.total_rollout_steps=2"
    )
    log = (run / "train.log").read_text()
    assert (
        "resharded: the checkpoint of rollout step 1 was written by 2 rank(s) (C = 1) and continues on 2 (C = 2)" in log
    )
    assert [r["rollout_step"] for r in metrics(run)] == ["1", "2"]
    one, resumed = experience(single_run, 1, world=1), experience(run, 1, world=1)  # one group: rank 0's dump
    assert resumed["dataset_indices"] == one["dataset_indices"] and resumed["response_ids"] == one["response_ids"]
    width = one["mask"].shape[1]
    torch.testing.assert_close(resumed["advantages"][:, :width], one["advantages"], atol=1e-5, rtol=0)
    difference = assert_same_weights(final_actor(run), final_actor(single_run), rel=1e-5)
    print(f"resumed at C = 2: largest difference {difference:.1e} of the largest weight")
