"""Multi-turn episodes under data parallelism: `python train.py +experiment=tool_arithmetic` on 2 CPU processes
gives the same episodes (ids, policy masks) and advantages as on one process (see tests/end_to_end/test_ddp.py for how the
2-process runs are made). Slow: two training runs with a warm start.

A warm start that calls the tool half of the time gives episodes with observations in every rollout batch, and
sampling at temperature 0.5 gives some of them the right answer, so rewards and advantages vary."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cli_runs import DDP, experience, metrics, train_cli

TOOLS = [
    "+experiment=tool_arithmetic",
    "model.warm_start.steps=100",
    "model.warm_start.tool_call_rate=0.5",
    "ppo.advantage_estimator=gae",
    "ppo.kl_mode=reward",
    "ppo.kl_estimator=k1",
    "ppo.micro_train_batch_size=32",
    "rollout.temperature=0.5",
]  # a 100-step warm start answers well greedily but not at temperature 1


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache):
    return train_cli(tmp_path_factory.mktemp("tools_single"), cache, *TOOLS)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, cache, one_process):
    return train_cli(tmp_path_factory.mktemp("tools_ddp"), cache, *TOOLS, *DDP)


@pytest.mark.slow
@pytest.mark.parametrize("rollout_step", [0, 1])
def test_episodes_and_advantages_do_not_depend_on_the_number_of_ranks(one_process, two_processes, rollout_step):
    one, two = experience(one_process, rollout_step, world=1), experience(two_processes, rollout_step, world=2)
    assert two["shard_sizes"] == [64, 64]
    assert two["prompt_positions"] == one["prompt_positions"] and two["dataset_indices"] == one["dataset_indices"]
    assert two["response_ids"] == one["response_ids"]
    width = one["mask"].shape[1]
    assert torch.equal(two["mask"][:, :width], one["mask"])
    # Episodes with an observation: a hole in the policy mask before its last policy token.
    lengths = torch.tensor([len(r) for r in one["response_ids"]])
    assert (one["mask"].sum(-1) < lengths).any(), "no episode called the tool"
    assert torch.equal(two["rewards"], one["rewards"]) and one["rewards"].std() > 0
    assert one["advantages"].abs().max() > 0.1
    for key in ("advantages", "returns", "values"):
        torch.testing.assert_close(two[key][:, :width], one[key], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.slow
def test_episode_metrics_are_those_of_the_whole_batch(one_process, two_processes):
    for one, two in zip(metrics(one_process), metrics(two_processes), strict=True):
        for key in (
            "rollout/turns_mean",
            "rollout/tool_calls",
            "rollout/tool_call_rate",
            "rollout/observation_tokens",
            "rollout/episode_tokens",
            "rollout/reward_mean",
        ):
            assert float(two[key]) == pytest.approx(float(one[key]), abs=1e-6), key
