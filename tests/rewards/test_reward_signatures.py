"""Reward functions of the peers used unchanged (reward.signature), and verifiers in worker processes
that hang, crash, or meet an expression math-verify cannot finish (reward.workers, reward.timeout_s)."""

from __future__ import annotations

import logging
import time

import pytest

from lit_ppo.errors import ConfigError
from lit_ppo.rewards import RewardError, RewardScorer, detect_signature
from tests.helpers import compose_run_config, fixture_run

PEER = "tests.fixtures.peer_rewards"


def scorer_for(target: str, *overrides: str, answer_key: str = "answer") -> RewardScorer:
    key = "null" if answer_key is None else answer_key
    cfg = compose_run_config(
        "reward=custom_example", f"reward.fn._target_={target}", f"data.answer_key={key}", *overrides
    )
    return RewardScorer.from_config(cfg)


@pytest.mark.parametrize(
    "name, signature", [("trl_accuracy", "trl"), ("compute_score", "verl"), ("reward_func", "openrlhf")]
)
def test_peer_reward_functions_are_called_as_their_framework_calls_them(name, signature, caplog):
    with caplog.at_level(logging.INFO, logger="lit_ppo"):
        scorer = scorer_for(f"{PEER}.{name}")
    assert (
        f"reward: {PEER}.{name}, called with the {signature} signature (chosen by reward.signature=auto" in caplog.text
    )
    scores = scorer(["1+1=", "2+2=", "3+3="], ["2", "5", "6"], ["2", "4", "6"], [{}] * 3, [False, False, True])
    assert scores == [1.0, 0.0, 1.0]
    if signature == "verl":  # the dict's other numeric entries become metrics; the string one is dropped
        assert scores.metrics["acc"] == pytest.approx(2 / 3) and "pred" not in scores.metrics
    if signature == "openrlhf":
        assert scores.metrics["exact"] == pytest.approx(2 / 3)


def test_trl_columns_by_name_and_none_means_not_applicable():
    scorer = scorer_for(f"{PEER}.trl_accuracy", answer_key="answer")
    scores = scorer(["a", "b"], ["x 7", "y"], [7, None], [{"topic": "t"}] * 2, [False, False])
    assert scores == [1.0, 0.0]
    assert scores.metrics["none"] == 1.0 and scores.metrics["errors"] == 0.0
    # the reference column goes by data.answer_key's name
    with pytest.raises(RewardError, match="unexpected keyword argument 'solution'|NoneType"):
        scorer_for(f"{PEER}.trl_accuracy", answer_key="solution")(["a"], ["7"], ["7"], [{}], [False])


def test_explicit_signature_and_ambiguous_functions():
    assert scorer_for(f"{PEER}.compute_score", "reward.signature=verl").call.signature == "verl"
    with pytest.raises(
        ConfigError,
        match=r"reward.signature=auto cannot tell how to call .*ambiguous\(args, kwargs\).*"
        r"fix: set reward.signature to one of lit_ppo, trl, verl, openrlhf",
    ):
        scorer_for(f"{PEER}.ambiguous")
    with pytest.raises(ConfigError, match="reward.signature='trll'"):
        scorer_for(f"{PEER}.compute_score", "reward.signature=trll")
    assert detect_signature(lambda p, r, ref, e: r) == "lit_ppo"  # today's contract under other names
    with pytest.raises(ConfigError, match="names completions and solution_str"):
        detect_signature(lambda prompts, completions, solution_str: 0)


# ------------------------------------------------------------------ worker processes


def test_a_verifier_that_hangs_is_timed_out_named_and_its_worker_replaced():
    scorer = scorer_for(f"{PEER}.sleepy_verifier", "reward.workers=2", "reward.timeout_s=2", "reward.on_error=zero")
    try:
        scores = scorer(["p0", "p1", "p2"], ["ok", "sleep now", "ok"], [None] * 3, [{}] * 3, [False] * 3)
        assert scores == [1.0, 0.0, 1.0]
        assert scores.metrics["timeouts"] == 1.0 and scores.metrics["errors"] == 0.0 and scorer.timeouts == 1
        assert scorer.pool.restarts == 1 and len(scorer.pool.workers) == 2
        assert scorer(["p"], ["ok"], [None], [{}], [False]) == [1.0]  # the rebuilt pool scores
        scorer.on_error = "raise"
        with pytest.raises(
            RewardError,
            match=r"timed out on sample 1 \(prompt 'p1', response 'sleep now'\): "
            r"no result after reward.timeout_s=2s",
        ):
            scorer(["p0", "p1"], ["ok", "sleep now"], [None] * 2, [{}] * 2, [False] * 2)
    finally:
        scorer.close()


def test_a_verifier_hanging_on_every_sample_in_workers_gives_up_on_the_rest_of_the_call(caplog):
    """reward.workers=2 and a function that hangs on everything (a remote judge that is down): the first two samples
    (one per worker) time out together, and the call's other six score as reward.on_error says at once, with one
    line. Before, every sample waited out reward.timeout_s in turn (a 128-sample step of 4 workers at the default
    60 s: 32 minutes) and each cost a new worker process."""
    scorer = scorer_for(f"{PEER}.sleepy_verifier", "reward.workers=2", "reward.timeout_s=2", "reward.on_error=zero")
    try:
        assert scorer(["p"] * 2, ["ok"] * 2, [None] * 2, [{}] * 2, [False] * 2) == [1.0, 1.0]  # workers started
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="lit_ppo"):
            scores = scorer(["p"] * 8, ["sleep"] * 8, [None] * 8, [{}] * 8, [False] * 8)
        seconds = time.monotonic() - started
        assert scores == [0.0] * 8 and scores.metrics["timeouts"] == 8.0 and scorer.timeouts == 8
        assert scorer.pool.restarts == 2  # the two timed-out workers; the others were never sent a sample
        given_up = [r.getMessage() for r in caplog.records if "looks hung" in r.getMessage()]
        assert given_up == [
            "reward: 2 samples in a row ran past reward.timeout_s=2s in the reward workers: the reward function looks "
            "hung (a remote service down?); the other 6 samples of this call score 0 without being scored "
            "(reward.on_error=zero, counted as timeouts)"
        ]
        assert seconds < 8 * 2 / 2  # a generous bound: one timeout and not four (about 2 s here)
        assert scorer(["p"], ["ok"], [None], [{}], [False]) == [1.0]  # the next call scores again
    finally:
        scorer.close()


def test_a_keyboard_interrupt_in_a_reward_worker_stops_the_run_naming_it_and_its_prints_reach_the_run_log(caplog):
    """A worker ignores SIGINT, so a KeyboardInterrupt there is the function's own: the run stops in one line naming
    it (it was scored 0 as a failure under on_error=zero). What the function prints in the worker is shown on the
    console and kept in run.log, as in this process (`console.capture_prints`)."""
    scorer = scorer_for(f"{PEER}.chatty_verifier", "reward.workers=1", "reward.on_error=zero")
    try:
        with caplog.at_level(logging.INFO):
            assert scorer(["p"] * 2, ["ok", "no"], [None] * 2, [{}] * 2, [False] * 2) == [1.0, 0.0]
        printed = [r.getMessage() for r in caplog.records if r.name == "lit_ppo.console"]
        assert printed == [f"reward function {PEER}.chatty_verifier printed: scoring {r!r}" for r in ("ok", "no")]
        with pytest.raises(RewardError) as info:
            scorer(["p"] * 2, ["ok", "stop"], [None] * 2, [{}] * 2, [False] * 2)
        message = str(info.value)
        assert (
            f"{PEER}.chatty_verifier raised KeyboardInterrupt on sample 1 (prompt 'p', in a reward worker)" in message
        )
        assert "whatever reward.on_error says" in message and "\n" not in message
    finally:
        scorer.close()


def test_a_verifier_that_kills_its_process_costs_only_its_sample():
    scorer = scorer_for(f"{PEER}.crashing_verifier", "reward.workers=1", "reward.on_error=zero")
    try:
        scores = scorer(["p0", "p1", "p2"], ["ok", "exit", "ok"], [None] * 3, [{}] * 3, [False] * 3)
        assert scores == [1.0, 0.0, 1.0]
        assert scores.metrics["errors"] == 1.0 and scores.metrics["timeouts"] == 0.0 and scorer.pool.restarts == 1
        scorer.on_error = "raise"
        with pytest.raises(
            RewardError,
            match=r"failed on sample 0 \(prompt 'p0', response 'exit'\): "
            r"killed its worker process \(exit code 3\)",
        ):
            scorer(["p0"], ["exit"], [None], [{}], [False])
    finally:
        scorer.close()


PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"  # math-verify tries to evaluate it and gives up at its timeout


@pytest.mark.parametrize("workers", [0, 1])
def test_math_verify_timeout_is_a_named_reward_timeout(workers):
    """math-verify's own SIGALRM timeout works in process (main thread) and in a worker's main thread, and
    what it cannot decide is a reward timeout, not a silent 0."""
    overrides = ["reward=math", "reward.fn.timeout_s=1", f"reward.workers={workers}", "reward.timeout_s=30"]
    cfg = compose_run_config(*overrides, "reward.on_error=zero")
    scorer = RewardScorer.from_config(cfg)
    try:
        scores = scorer(["q0", "q1"], ["#### 5", PATHOLOGICAL], ["5", "5"], [{}] * 2, [False] * 2)
        assert scores == [1.0, 0.0]
        assert scores.metrics["timeouts"] == 1.0 and scores.metrics["errors"] == 0.0
        scorer.on_error = "raise"
        with pytest.raises(
            RewardError,
            match=r"timed out on sample 0 \(prompt 'q1', response '\\\\boxed\{9\^.*"
            r"math-verify could not compare",
        ):
            scorer(["q1"], [PATHOLOGICAL], ["5"], [{}], [False])
    finally:
        scorer.close()


@pytest.mark.slow  # make test: the pool's hang, crash and restart tests above; on_error=zero counted in test_workloads.py
def test_training_continues_past_a_crashing_and_a_hanging_verifier(engine, tmp_path, caplog):
    """Two rollout steps with reward.workers=2 and on_error=zero: one sample kills its worker, one hangs
    past reward.timeout_s; both score 0, are named in the log, and the run finishes."""
    overrides = (
        "reward=custom_example",
        "reward.fn._target_=tests.fixtures.peer_rewards.flaky_verifier",
        f"+reward.fn.state_dir={tmp_path}",
        "reward.workers=2",
        "reward.timeout_s=3",
        "reward.on_error=zero",
        "trainer.eval_every=0",
        "ppo=grpo",
    )
    with caplog.at_level(logging.INFO, logger="lit_ppo"):
        summary = fixture_run(engine, tmp_path, *overrides)
    assert summary["rollout_steps"] == 2 and summary["optimizer_steps_actor"] == summary["expected_optimizer_steps"]
    assert (tmp_path / "crashed").exists() and (tmp_path / "hung").exists()
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reward: sample ")]
    assert len(failed) == 2, failed
    assert "failed and scores 0" in failed[0] and "killed its worker process (exit code 3)" in failed[0]
    assert "timed out and scores 0" in failed[1] and "no result after reward.timeout_s=3s" in failed[1]
