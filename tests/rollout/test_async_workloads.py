"""Asynchronous rollouts for every workload (issue 36, docs/async.md): rollout workers that run any engine of the
contract (rollout.engine=hf: a copy of the actor loaded by the worker, pushed weights or adapters applied to it) and
multi-turn episodes with tools (the environment built in the worker from the run's settings). At k = 0 each equals
its colocated run step for step; at k = 1 the versions follow the plan; a failing or hanging tool in a worker is
counted, as in colocated runs."""

from __future__ import annotations

import copy
import logging

import lightning as L
import pytest
import torch

from lit_ppo.config import (
    EpisodesConfig,
    LoraConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    WorkersConfig,
)
from lit_ppo.errors import RolloutWorkerError
from lit_ppo.plan import compute_plan
from lit_ppo.rollout.datamodule import RolloutDataModule
from lit_ppo.rollout.episodes import Episode
from lit_ppo.rollout.schedule import AheadOfTimeSource
from lit_ppo.rollout.workers.client import RolloutWorkers
from tests.helpers import build_run, compose_run_config, plan_of
from tests.helpers.asynchronous import digit_share, step_request
from tests.helpers.episodes import ENVIRONMENT, FLAKY_ENVIRONMENT, RAISING_ENVIRONMENT

TIS = RolloutCorrectionConfig(mode="tis")


def rollout_config(mode: str, k: int = 0, engine: str = "hf", episodes: EpisodesConfig | None = None, count: int = 1):
    """The tests' rollouts (temperature != 1, short responses) colocated or on `count` rollout workers with
    max_staleness k, on `engine`, single-turn or `episodes`."""
    workers = {}  # colocated: the workers' settings at their defaults (others are refused there)
    if mode == "disaggregated":
        workers_config = WorkersConfig(count=count, start_timeout_s=300.0, batch_timeout_s=120.0)
        workers = {"mode": "disaggregated", "max_staleness": k, "workers": workers_config}
    return RolloutConfig(
        engine=engine,
        max_response_tokens=6,
        eval_samples_per_prompt=2,
        temperature=0.8,
        **({"episodes": episodes} if episodes else {}),
        **workers,
    )


class Recorder(L.Callback):
    """The actor's trained tensors after every rollout step, every trained batch and the workers' exit codes."""

    def __init__(self):
        self.versions: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.versions.append(copy.deepcopy(module.actor.state_dict()))


SMALL = {"rollout_batch_size": 4, "train_batch_size": 8, "micro_train_batch_size": 8}
"""16 samples per rollout step, 2 optimizer steps each: the policy moves between versions."""


def run(model_dir, files, out, rollout, steps=3, **kwargs):
    """`steps` rollout steps of the tiny model; returns (module, trained batches, recorder, worker log or "")."""
    batches = []

    class Recording(RolloutDataModule):
        def produce_rollout(self, rollout_step):
            batches.append(super().produce_rollout(rollout_step))
            return batches[-1]

    recorder = Recorder()
    trainer, module, datamodule, plan = build_run(
        model_dir,
        None,
        files,
        out,
        total_rollout_steps=steps,
        rollout=rollout,
        callbacks=[recorder],
        datamodule_class=Recording,
        reward_fn=digit_share,
        **{**SMALL, **kwargs},
    )
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        datamodule.engine.close()
    if isinstance(datamodule.engine, RolloutWorkers):
        assert set(datamodule.engine.exit_codes) == {0}
    log = out / "logs" / "rollout_worker0.log"
    return module, batches, recorder, log.read_text() if log.exists() else ""


def assert_same_steps(ours, theirs, recorder_ours, recorder_theirs, episodes=False):
    """Step for step: the same prompts, samples, log-probs, rewards (and masks), and the same weights after."""
    for a, b in zip(ours, theirs, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids, a.rollout_step
        assert torch.equal(a.rewards, b.rewards) and torch.equal(a.truncated, b.truncated)
        diff = max(abs(x - y) for p, q in zip(a.rollout_logprobs, b.rollout_logprobs) for x, y in zip(p, q))
        assert diff < 1e-5, (a.rollout_step, diff)
        if episodes:
            assert a.policy_masks == b.policy_masks and a.episode_ids == b.episode_ids
            assert a.episode_stats == b.episode_stats
    for v_ours, v_theirs in zip(recorder_ours.versions, recorder_theirs.versions, strict=True):
        for name, tensor in v_ours.items():
            torch.testing.assert_close(tensor, v_theirs[name], atol=1e-6, rtol=0, msg=name)


# ---------------------------------------------------------------- settings and the plan


def test_the_hf_engine_and_episodes_are_planned_in_the_workers():
    config = compose_run_config(
        "rollout.mode=disaggregated", "rollout.engine=hf", "+experiment=tool_arithmetic", "strategy.precision=32-true"
    )
    plan = compute_plan(config, 4000)
    rows = {row[0]: row for row in plan.models.rows(workers=plan.workers is not None, lora=plan.lora)}
    assert rows["engine"][1] == "hf" and "in each rollout worker" in rows["engine"][2], rows["engine"]
    assert plan.workers.max_staleness == 1 and plan.episodes.max_turns == 3


def test_a_checkpoint_keeps_episodes_generated_ahead_with_their_masks():
    """k = 1: the episodes of the step generated ahead, kept by a checkpoint, come back as episodes (policy masks,
    episode ids, failures) in the resumed source, not as single-turn generations."""
    plan = plan_of(256, rollout=RolloutConfig(mode="disaggregated", max_staleness=1), steps=4)

    class EpisodeWorkers:
        version = 0

        def submit(self, request):
            return request.seeds[0]

        def collect(self, step):
            episode = Episode(
                0, [5, 6, 7], False, "", [-1.0, 0.0, -1.0], policy_mask=[1, 0, 1], episode_ids=[1, 5, 6, 7]
            )
            episode.failure = "timeout" if step else None
            return [episode], [self.version], 0.1

    source, workers = AheadOfTimeSource(plan), EpisodeWorkers()
    source.take(0, workers, None, lambda step, round_in_step=0: step_request(step, [[1]], n=1))
    source.collect(workers)
    state = source.state_dict()
    resumed = AheadOfTimeSource(plan)
    resumed.load_state_dict(state)
    (kept,) = resumed.received[1][0].generations  # step 1, its first (only) generation round
    assert isinstance(kept, Episode) and kept.policy_mask == [1, 0, 1] and kept.episode_ids == [1, 5, 6, 7]
    assert kept.failure == "timeout"


# ---------------------------------------------------------------- rollout.engine=hf in the workers


@pytest.mark.slow  # make test: test_episodes_in_hf_workers_at_k0_equal_the_colocated_run (HF workers at k = 0, 2 of them)
def test_hf_workers_at_k0_equal_the_colocated_hf_run_step_for_step(tiny_model_dir, long_prompt_files, tmp_path):
    """The worker's own HF engine, loaded from model_dir and given each pushed version, samples what the colocated HF
    engine (the actor itself) samples: same responses, log-probs, rewards, and the same weights after every step."""
    _, colocated, rec_colocated, _ = run(
        tiny_model_dir, long_prompt_files, tmp_path / "c", rollout_config("colocated"), steps=2
    )
    module, workers, rec_workers, log = run(
        tiny_model_dir, long_prompt_files, tmp_path / "w", rollout_config("disaggregated", 0), steps=2
    )
    assert [sorted(set(b.policy_versions)) for b in workers] == [[0], [1]]
    assert_same_steps(workers, colocated, rec_workers, rec_colocated)
    assert "hf engine started" in log and all(f"policy version {v} applied" in log for v in range(3)), log[-2000:]
    assert all(row["rollout/logprob_abs_diff"] < 1e-4 for row in module.history)


def test_hf_workers_at_k1_with_lora_sample_the_planned_versions_and_adapters(
    tiny_model_dir, long_prompt_files, tmp_path
):
    """k = 1 with model.lora on an HF-engine worker: versions max(0, s - 1), each sample recording the adapter pushed
    for its version (checked by the trainer, check_adapter_versions), and the worker's log-probs equal the trainer's
    under that version's adapter (the probe check after each push; the batch of lag 0)."""
    lora = LoraConfig(rank=8, alpha=16.0)
    module, batches, _, log = run(
        tiny_model_dir,
        long_prompt_files,
        tmp_path,
        rollout_config("disaggregated", 1),
        lora=lora,
        actor_lr=5e-3,
        rollout_correction=TIS,
    )
    assert [sorted(set(b.policy_versions)) for b in batches] == [[0], [0], [1]]
    assert [sorted(set(b.adapter_versions)) for b in batches] == [[1], [1], [2]]
    lags = [row["rollout/policy_version_lag"] for row in module.history]
    assert lags == [0.0, 1.0, 1.0]
    assert module.history[0]["rollout/logprob_abs_diff"] < 1e-4 < module.history[2]["rollout/logprob_abs_diff"]
    assert all(f"policy version {v} applied" in log for v in range(4))


# ---------------------------------------------------------------- multi-turn episodes in the workers


EPISODES = EpisodesConfig(environment=ENVIRONMENT, max_turns=3, max_tokens=30)


def test_episodes_in_hf_workers_at_k0_equal_the_colocated_run(tiny_model_dir, arithmetic_files, tmp_path):
    """Episodes with a tool, generated by two workers (each its share of the prompts, seeded by their global
    positions) with the environment each built from the run's settings: the same episodes (ids, policy masks,
    log-probs), rewards and episode counts as the colocated run, and the same weights. (No evaluation: the slow vLLM
    test below evaluates episodes through the workers.)"""
    files = (arithmetic_files[0], None)
    _, colocated, rec_c, _ = run(
        tiny_model_dir, files, tmp_path / "c", rollout_config("colocated", episodes=EPISODES), steps=2
    )
    module, workers, rec_w, _ = run(
        tiny_model_dir,
        files,
        tmp_path / "w",
        rollout_config("disaggregated", 0, episodes=EPISODES, count=2),
        steps=2,
    )
    assert any(0 in m for b in workers for m in b.policy_masks), "no episode with an observation"
    assert_same_steps(workers, colocated, rec_w, rec_c, episodes=True)
    row = module.history[-1]
    assert row["rollout/turns_mean"] > 1 and row["rollout/tool_calls"] > 0


def test_a_failing_or_hanging_tool_in_a_worker_is_counted_as_in_a_colocated_run(
    tiny_model_dir, arithmetic_files, tmp_path, caplog
):
    """reward.on_error=zero: episodes whose tool raises or hangs past rollout.episodes.environment_timeout_s in the
    worker score 0 and are counted in rollout/environment_errors and _timeouts exactly as the colocated run counts
    them, the worker's warning line is logged by the trainer, and the hanging call is bounded per turn."""
    episodes = EpisodesConfig(environment=FLAKY_ENVIRONMENT, max_turns=3, max_tokens=30, environment_timeout_s=0.5)
    files = (arithmetic_files[0], None)  # no evaluation (its tool calls would hang too)
    c_module, colocated, *_ = run(
        tiny_model_dir,
        arithmetic_files,
        tmp_path / "c",
        rollout_config("colocated", episodes=episodes),
        steps=1,
        on_error="zero",
    )
    with caplog.at_level(logging.WARNING, logger="lit_ppo"):
        w_module, workers, _, log = run(
            tiny_model_dir,
            files,
            tmp_path / "w",
            rollout_config("disaggregated", 0, episodes=episodes),
            steps=1,
            on_error="zero",
        )
    (ours,), (theirs,) = workers, colocated
    assert ours.episode_stats == theirs.episode_stats and torch.equal(ours.rewards, theirs.rewards)
    assert ours.episode_stats["environment_errors"] > 0 and ours.episode_stats["environment_timeouts"] > 0
    for key in ("rollout/environment_errors", "rollout/environment_timeouts"):
        assert w_module.history[0][key] == c_module.history[0][key] > 0
    said = [r.getMessage() for r in caplog.records if "after environment errors" in r.getMessage()]
    assert [m for m in said if m.startswith("rollout worker 0: rollout step 1: 4 of 16 episodes")], said
    assert "after environment errors" in log


def test_a_failing_tool_under_on_error_raise_stops_the_run_naming_the_worker(
    tiny_model_dir, arithmetic_files, tmp_path
):
    """reward.on_error=raise: the environment's failure in a worker stops the run in one line, the worker's
    EnvironmentFailure (with its fix) as the trainer reports a failed worker."""
    episodes = EpisodesConfig(environment=RAISING_ENVIRONMENT, max_turns=3, max_tokens=30)
    with pytest.raises(RolloutWorkerError) as info:
        run(
            tiny_model_dir, (arithmetic_files[0], None), tmp_path, rollout_config("disaggregated", 0, episodes=episodes)
        )
    message = str(info.value)
    assert "\n" not in message and message.startswith("trainer: rollout worker 0 "), message
    assert "EnvironmentFailure: rollout step 1: the environment RaisingCalculator.step failed" in message, message
    assert "rollout_worker0.log" in message


@pytest.mark.slow
def test_episodes_in_vllm_workers_equal_the_colocated_run_at_k0_and_follow_the_plan_at_k1(
    tiny_model_dir, arithmetic_files, tmp_path
):
    """The same with vLLM engines (the colocated run's in process, the worker's its own), and at k = 1 every
    episode of step s is generated by version max(0, s - 1)."""
    vllm = dict(engine="vllm", episodes=EPISODES)
    _, colocated, rec_c, _ = run(tiny_model_dir, arithmetic_files, tmp_path / "c", rollout_config("colocated", **vllm))
    _, workers, rec_w, _ = run(
        tiny_model_dir, arithmetic_files, tmp_path / "w", rollout_config("disaggregated", 0, **vllm)
    )
    for a, b in zip(workers, colocated, strict=True):
        assert a.response_ids == b.response_ids and a.policy_masks == b.policy_masks
        assert torch.equal(a.rewards, b.rewards) and a.episode_stats == b.episode_stats
    module, one_off, _, _ = run(
        tiny_model_dir,
        arithmetic_files,
        tmp_path / "k1",
        rollout_config("disaggregated", 1, **vllm),
        rollout_correction=TIS,
    )
    assert [sorted(set(b.policy_versions)) for b in one_off] == [[0], [0], [1]]
    assert [row["rollout/policy_version_lag"] for row in module.history] == [0.0, 1.0, 1.0]
    assert one_off[0].response_ids == colocated[0].response_ids  # step 0: version 0 in both
