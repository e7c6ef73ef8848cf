"""Data parallelism on CPU: `python train.py strategy=ddp strategy.devices=2 strategy.accelerator=cpu`,
and the same with `strategy=fsdp` (FSDP2 through Lightning's ModelParallelStrategy).

Lightning starts the second process itself (gloo); each rank holds its own vLLM engine (colocated,
vLLM's external_launcher backend), generates for its half of every rollout batch and receives the
updated weights after each rollout step. Compared with one process on the same settings:
- the samples, rewards and advantages of every rollout step are the same (the sampling seeds follow
  a prompt's global position; advantage statistics are all-reduced);
- the logged rollout metrics are those of the whole rollout batch, not of rank 0's half, and the actor's loss
  statistics those of each global mini-batch;
- the final actor is the same, to float32 rounding: the mini-batches of a rollout step are the same sets of samples on
  any number of ranks (one shuffle of the global samples, each rank training its share of each mini-batch);
- a run resumed from a DDP checkpoint continues exactly as the uninterrupted run;
- the 2-process checkpoint, resumed by `resume=auto` on one process, continues as the 1-process run (resharding);
- an error on one rank stops every rank.

Settings that make the comparison meaningful: `reward.overlong_penalty=1` gives rewards that vary
(a 20-step warm start solves no problem yet, so the task reward alone would be 0 everywhere and
every advantage 0); the default two mini-batches per PPO epoch (`ppo.train_batch_size=64` of 128
samples) and 2 PPO epochs, so each rollout step takes 4 optimizer steps on reshuffled mini-batches.
The updates agree to float32 rounding, so the second rollout step's samples match too.

The debug variable LIT_PPO_DUMP_ADVANTAGES makes every rank save its experience per rollout step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.cli_runs import (
    DDP,
    STRATEGIES,
    assert_no_rank_left,
    assert_same_weights,
    experience,
    final_actor,
    metrics,
    train_cli,
)

ROLLOUT_METRICS = [
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/response_length_mean",
    "rollout/response_length_max",
    "rollout/truncated_fraction",
    "rollout/generated_tokens",
    "rollout/kl_to_reference",
    "rollout/advantage_mean",
    "critic/explained_variance",
]
ACTOR_STATISTICS = ["actor/policy_loss", "actor/clip_fraction", "actor/approx_kl", "actor/entropy"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, cache) -> Path:
    return train_cli(tmp_path_factory.mktemp("single"), cache)  # also fills the model cache for the others


@pytest.fixture(scope="module", params=list(STRATEGIES))
def parallel_run(request, tmp_path_factory, cache, single_run) -> tuple[str, Path]:
    """A 2-process run of each strategy: (strategy, output directory)."""
    return request.param, train_cli(tmp_path_factory.mktemp(request.param), cache, *STRATEGIES[request.param])


# The resumes of the FSDP run are `make test-slow`'s (about 40 s): `make test` resumes the DDP run and trains the FSDP run.
RESUMES_OF_EACH_STRATEGY = pytest.mark.parametrize(
    "parallel_run", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)], indirect=True
)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, cache, parallel_run) -> Path:
    """A fresh output directory resuming from the 2-process run's checkpoint after rollout step 1."""
    strategy, run = parallel_run
    out = tmp_path_factory.mktemp(f"resumed_{strategy}")
    checkpoint = shutil.copy(run / "checkpoints" / "rollout_step_000001.ckpt", out / "start.ckpt")
    return train_cli(out, cache, *STRATEGIES[strategy], f"resume={checkpoint}")


@pytest.fixture(scope="module")
def resumed_on_one_rank(tmp_path_factory, cache, parallel_run) -> Path:
    """The 2-process run's directory as a requeued job finds it after rollout step 1 (its config.yaml and that
    checkpoint), continued with `resume=auto` on one process of the same strategy."""
    strategy, run = parallel_run
    out = tmp_path_factory.mktemp(f"on_one_rank_{strategy}")
    (out / "checkpoints").mkdir()
    shutil.copy(run / "config.yaml", out / "config.yaml")
    shutil.copy(run / "checkpoints" / "rollout_step_000001.ckpt", out / "checkpoints")
    return train_cli(out, cache, *STRATEGIES[strategy], "strategy.devices=1", "resume=auto")


def test_two_processes_train_with_an_engine_per_rank(parallel_run):
    _, run = parallel_run
    log = (run / "logs" / "run.log").read_text()  # Lightning's own lines go to run.log, not the console
    assert "Starting with 2 processes" in log and "distributed_backend=gloo" in log
    console = (run / "train.log").read_text()  # what the user sees: rank 0's lines once, not one copy per rank
    assert console.count("Step plan") == 1 and console.count("run finished") == 1
    rank1_log = (run / "logs" / "run.rank1.log").read_text()  # rank 1 keeps its own log
    # rank 1 started an engine of its own: VLLMEngine logs its warm-up once the engine is up
    assert "INFO lit_ppo.rollout.engine: vLLM warm-up (its log-prob kernel's compilation): " in rank1_log, rank1_log[
        -2000:
    ]
    plan = json.loads((run / "plan.json").read_text())
    assert plan["counts"]["data_parallel_size"] == 2 and plan["counts"]["samples_per_rank_per_rollout_step"] == 64
    assert (
        plan["layout"]["packing"] and plan["layout"]["rank_balance"]
    )  # the tiny Qwen2 model packs: ranks balanced by real tokens
    assert plan["counts"]["optimizer_steps_per_rollout_step"] == 4  # 128 samples / 64 per update x 2 PPO epochs
    assert plan["layout"]["grad_accumulation_steps"] == 1  # 64 / (32 per micro-batch x 2 ranks)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data_parallel_size"] == 2 and summary["rollout_steps"] == 2
    assert (
        summary["optimizer_steps_actor"]
        == summary["optimizer_steps_critic"]
        == summary["expected_optimizer_steps"]
        == 8
    )
    assert summary["samples_generated"] == 2 * 32 * 4
    rows = metrics(run)
    assert [int(r["rollout_step"]) for r in rows] == [1, 2] and [int(r["optimizer_step"]) for r in rows] == [4, 8]
    assert {"eval/reward", "timing/weight_sync_s"} <= set(rows[-1])
    for step in range(2):
        # Each rank generated its own half of the rollout batch with its own engine: 16 prompts x 4 samples.
        exp = experience(run, step, world=2)
        assert exp["shard_sizes"] == [64, 64]
        assert exp["prompt_positions"] == [p for p in range(32) for _ in range(4)]
        assert all(len(r) > 0 for r in exp["response_ids"])
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == [
        "rollout_step_000001.ckpt",
        "rollout_step_000002.ckpt",
    ]
    assert (run / "actor" / "config.json").exists()


def test_packed_ranks_train_whole_prompt_groups_balanced_by_real_tokens(parallel_run):
    """Each rank trains 16 whole prompt groups (4 samples each, contiguous, in prompt order) after the split by real
    tokens, not necessarily those it generated; the heaviest rank's real tokens are no further from the mean than in
    the contiguous split generation made, and within 1 % of it (groups of 4 responses of up to 8 tokens)."""
    _, run = parallel_run
    for step in range(2):
        for positions in experience(run, step, world=2)["rank_positions"]:
            assert len(positions) == 64 and positions == sorted(positions)
            assert all(positions[i : i + 4] == [positions[i]] * 4 for i in range(0, 64, 4))
    for row in metrics(run):
        balanced, contiguous = (
            float(row["perf/rank_token_imbalance"]),
            float(row["perf/rank_token_imbalance_contiguous"]),
        )
        assert 1.0 <= balanced <= contiguous and balanced < 1.01


@pytest.mark.parametrize("rollout_step", [0, 1])
def test_samples_and_advantages_do_not_depend_on_the_number_of_ranks(single_run, parallel_run, rollout_step):
    _, run = parallel_run
    one, two = experience(single_run, rollout_step, world=1), experience(run, rollout_step, world=2)
    assert two["prompt_positions"] == one["prompt_positions"]
    assert two["dataset_indices"] == one["dataset_indices"]
    assert two["response_ids"] == one["response_ids"]
    assert torch.equal(two["rewards"], one["rewards"]) and two["rewards"].std() > 0
    width = one["mask"].shape[1]
    assert torch.equal(two["mask"][:, :width], one["mask"])
    assert one["advantages"].abs().max() > 0.1  # a real signal, not zeros compared with zeros
    for key in ("advantages", "returns", "values"):
        torch.testing.assert_close(two[key][:, :width], one[key], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")


def test_logged_rollout_metrics_are_those_of_the_whole_batch(single_run, parallel_run):
    _, run = parallel_run
    for one, two in zip(metrics(single_run), metrics(run), strict=True):
        for key in ROLLOUT_METRICS + ["actor/grad_norm", "critic/grad_norm"]:
            assert float(two[key]) == pytest.approx(float(one[key]), abs=1e-4), key
        for key in ACTOR_STATISTICS + ["critic/value_loss"]:  # weighted over each global mini-batch, not per rank
            assert float(two[key]) == pytest.approx(float(one[key]), rel=1e-4, abs=1e-8), key
    # Evaluation is split over the ranks and all-reduced: the same numbers as on one process.
    single, parallel = (json.loads((r / "summary.json").read_text()) for r in (single_run, run))
    for key in (
        "eval_reward_initial",
        "eval_reward_final",
        "eval_final/response_length",
        "eval_final/pass@4",
        "tokens_generated",
    ):
        assert parallel[key] == pytest.approx(single[key], abs=1e-6), key


def test_final_actor_does_not_depend_on_the_number_of_ranks(single_run, parallel_run):
    """Two rollout steps of 2 PPO epochs of 2 mini-batches each: the global mini-batches are one process's."""
    assert_same_weights(final_actor(parallel_run[1]), final_actor(single_run))


@pytest.fixture(scope="module")
def padded_runs(tmp_path_factory, cache, single_run) -> tuple[Path, Path]:
    """The default one PPO epoch of two mini-batches per rollout step, padded micro-batches (each rank's share of a
    mini-batch is a run of the shuffled order, not a split by tokens): (1 process, 2 processes under DDP)."""
    settings = ["ppo.ppo_epochs=1", "ppo.packing=false"]
    one = train_cli(tmp_path_factory.mktemp("padded_single"), cache, *settings)
    return one, train_cli(tmp_path_factory.mktemp("padded_ddp"), cache, *settings, *DDP)


@pytest.mark.slow  # two runs (42 s); make test keeps the packed 2-rank comparison above
def test_two_padded_ranks_make_one_process_s_update_with_the_default_mini_batches(padded_runs):
    one, two = padded_runs
    assert json.loads((two / "plan.json").read_text())["counts"]["optimizer_steps_per_rollout_step"] == 2
    assert_same_weights(final_actor(two), final_actor(one))
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert float(b["actor/grad_norm"]) == pytest.approx(float(a["actor/grad_norm"]), rel=1e-5)
        for key in ACTOR_STATISTICS:
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4, abs=1e-8), key


@pytest.mark.slow  # make test keeps test_a_two_rank_checkpoint_resumes_on_one_rank[ddp] (train.py resume=auto, exact)
@RESUMES_OF_EACH_STRATEGY
def test_resumed_run_continues_exactly(parallel_run, resumed_run):
    _, run = parallel_run
    full, resumed = (json.loads((r / "summary.json").read_text()) for r in (run, resumed_run))
    for key in (
        "rollout_steps",
        "optimizer_steps_actor",
        "optimizer_steps_critic",
        "samples_generated",
        "tokens_generated",
    ):
        assert resumed[key] == full[key], key
    assert [r["rollout_step"] for r in metrics(resumed_run)] == ["1", "2"]  # history restored, no repeats
    assert not (resumed_run / "dump" / "rollout_step=000000.rank0.pt").exists()  # step 0 was not redone
    a, b = experience(run, 1, world=2), experience(resumed_run, 1, world=2)
    assert b["response_ids"] == a["response_ids"]
    torch.testing.assert_close(b["advantages"], a["advantages"], atol=1e-5, rtol=0)
    final, final_resumed = final_actor(run), final_actor(resumed_run)
    assert final.keys() == final_resumed.keys()
    for name in final:
        torch.testing.assert_close(final_resumed[name], final[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@RESUMES_OF_EACH_STRATEGY
def test_a_two_rank_checkpoint_resumes_on_one_rank(single_run, parallel_run, resumed_on_one_rank):
    """2 ranks -> 1: the checkpoint after rollout step 1 of the 2-process run, resumed by one process, makes the
    update a 1-process run makes. Compared with the uninterrupted 1-process run: its second rollout step's samples
    (exactly), advantages, and the final actor, within the tolerance of the 2-rank vs 1-rank comparison above (the
    2-rank checkpoint's weights equal the 1-rank run's to float32 summation order)."""
    log = (resumed_on_one_rank / "train.log").read_text()
    assert "resharded: the checkpoint of rollout step 1 was written by 2 rank(s) and continues on 1" in log
    summary = json.loads((resumed_on_one_rank / "summary.json").read_text())
    single = json.loads((single_run / "summary.json").read_text())
    assert summary["data_parallel_size"] == 1
    for key in ("rollout_steps", "optimizer_steps_actor", "optimizer_steps_critic", "samples_generated"):
        assert summary[key] == single[key], key
    assert [r["rollout_step"] for r in metrics(resumed_on_one_rank)] == ["1", "2"]  # history carried, no repeat
    assert not (resumed_on_one_rank / "dump" / "rollout_step=000000.rank0.pt").exists()  # step 0 was not redone
    one, resumed = experience(single_run, 1, world=1), experience(resumed_on_one_rank, 1, world=1)
    assert resumed["dataset_indices"] == one["dataset_indices"]  # the data position, carried
    assert resumed["response_ids"] == one["response_ids"]
    torch.testing.assert_close(resumed["advantages"], one["advantages"], atol=1e-5, rtol=0)
    assert_same_weights(final_actor(resumed_on_one_rank), final_actor(single_run))


def stopped_ddp_run(tmp_path: Path, cache: Path, reward_source: str, *overrides: str) -> Path:
    """A 2-rank DDP `python train.py` with the reward module rank_reward.py of `reward_source` (on its path), stopped
    with exit code 2; `overrides` on top."""
    (tmp_path / "rank_reward.py").write_text(reward_source)
    return train_cli(tmp_path / "run", cache, *DDP, *overrides, returncode=2, pythonpath=(str(tmp_path),))


FAILING_REWARD = """
import os

def fail_on_rank_0(prompts, responses, references, extras):
    if os.environ["RANK"] == "0":
        raise ValueError("this reward fails on rank 0")
    return [0.0] * len(responses)
"""


def test_an_error_on_rank_0_stops_every_rank(tmp_path, cache, single_run):
    """Rank 0 stops with the one-line error; rank 1, which it started, does not wait on in a collective. The ranks
    generate with the HF engine: what is tested is the ranks' stop, not an engine's, and no vLLM start is paid."""
    out = stopped_ddp_run(
        tmp_path, cache, FAILING_REWARD, "rollout.engine=hf", "reward.fn._target_=rank_reward.fail_on_rank_0"
    )
    log = (out / "train.log").read_text()
    assert "error: reward function rank_reward.fail_on_rank_0" in log and "this reward fails on rank 0" in log
    assert "Connection closed by peer" not in log  # rank 1 was stopped, not left to fail in its next all-reduce
    assert_no_rank_left(out)


HANGING_REWARD = """
import os
import time

def hang_on_rank_1(prompts, responses, references, extras):
    if os.environ["RANK"] == "1":
        time.sleep(3600)
    return [0.0] * len(responses)
"""


@pytest.mark.slow
def test_a_rank_that_hangs_stops_the_run_naming_the_phase(tmp_path, cache, single_run):
    """Rank 1's reward hangs in the first evaluation (no reward limit): rank 0 waits in that evaluation's all-reduce
    for trainer.collective_timeout_s, then stops the run in one line naming the evaluation, and stops rank 1."""
    out = stopped_ddp_run(
        tmp_path,
        cache,
        HANGING_REWARD,
        "data.n_eval=8",
        "reward.fn._target_=rank_reward.hang_on_rank_1",
        "reward.timeout_s=null",
        "trainer.collective_timeout_s=30",
    )
    log = (out / "train.log").read_text()  # the error line follows the progress bar's last state
    errors = [line[line.index("error: ") :] for line in log.splitlines() if "error: " in line]
    assert errors == [
        "error: rank 0 waited more than trainer.collective_timeout_s=30s for the other ranks in the evaluation before "
        "rollout step 1; a rank hung or stopped there (its log: <run>/logs/run.rank<N>.log); fix: find what held it "
        "up, or raise trainer.collective_timeout_s if the evaluation before rollout step 1 is only slow on some ranks"
    ]
    assert_no_rank_left(out)


@pytest.mark.slow
def test_dynamic_sampling_does_not_depend_on_the_number_of_ranks(tmp_path_factory, cache):
    """ppo=dapo on two processes: every rank judges the same gathered groups and takes its share of the kept ones,
    so the trained samples, the rounds drawn and the counts logged are those of one process."""
    dapo = ["ppo=dapo", "ppo.ppo_epochs=1"]
    one = train_cli(tmp_path_factory.mktemp("dapo_single"), cache, *dapo)
    two = train_cli(tmp_path_factory.mktemp("dapo_ddp"), cache, *dapo, *DDP)
    keys = (
        "rollout/generation_rounds",
        "rollout/dropped_groups",
        "rollout/filled_groups",
        "rollout/prompts_consumed",
        "rollout/reward_mean",
    )
    rows_one, rows_two = metrics(one), metrics(two)
    assert [[r[k] for k in keys] for r in rows_two] == [[r[k] for k in keys] for r in rows_one]
    assert max(int(r["rollout/generation_rounds"]) for r in rows_one) > 1  # the refill happened
    for step in range(2):
        a, b = experience(one, step, world=1), experience(two, step, world=2)
        assert b["shard_sizes"] == [64, 64]
        for key in ("prompt_positions", "dataset_indices", "response_ids"):
            assert b[key] == a[key], key
        assert torch.equal(b["rewards"], a["rewards"])
    summary = json.loads((two / "summary.json").read_text())
    assert summary["optimizer_steps_actor"] == summary["expected_optimizer_steps"]
