"""The rollout schedule (lit_ppo/rollout/schedule.py): which policy version generates which rollout step, what is in
flight and what was received, driven as the trainer drives it; and the data module, which never asks for the mode."""

from __future__ import annotations

import ast

import pytest

from lit_ppo.config import RolloutConfig
from lit_ppo.contract import GenerateRequest, Generation
from lit_ppo.rollout.schedule import AheadOfTimeSource, SynchronousSource, source_for
from tests.helpers import ROOT, datamodule_on, plan_of
from tests.helpers.asynchronous import STEPS, QueueingWorkers, not_here, plan, step_request


def request(step: int, round_in_step: int = 0) -> GenerateRequest:
    return step_request(step, [[1, 2], [3]], n=2)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_each_step_is_requested_k_ahead_after_its_versions_push_and_received_in_order(k):
    """At step s the requests reach s + k (past the plan's end too: the last checkpoint keeps them for a run extended
    on resume), each made while the workers hold the version the plan gives it; only s is received; every sample is
    of the plan's version."""
    p = plan(k)
    source, workers = AheadOfTimeSource(p), QueueingWorkers()
    for s in range(STEPS):
        got = source.take(s, workers, not_here, request)
        assert workers.submitted == list(range(s + k + 1))
        assert workers.collected == list(range(s + 1))
        assert got.policy_versions == [p.generating_version(s)] * 4
        assert [g.token_ids[0] for g in got.generations] == [s] * 4
        assert got.generate_seconds == 0.5 and got.wait_seconds is not None
        workers.version = s + 1  # the push after the step's updates


def test_a_checkpoint_collects_what_is_in_flight_and_a_resumed_source_goes_on_with_the_plans_versions():
    """k = 2, a checkpoint after step 1: steps 2 and 3 (requested with versions 0 and 1, which a resumed run no longer
    has) are received into the state; the resumed source takes them from there and requests step 4 with version 2."""
    p = plan(2)
    source, workers = AheadOfTimeSource(p), QueueingWorkers()
    for s in range(2):
        source.take(s, workers, not_here, request)
        workers.version = s + 1
    assert sorted(source.in_flight) == [2, 3]
    with pytest.raises(RuntimeError, match=r"rollout steps \[2, 3\] are in flight; collect them first"):
        source.state_dict()
    source.collect(workers)
    state = source.state_dict()
    assert sorted(state["prefetched"]) == [2, 3] and workers.collected == [0, 1, 2, 3]

    resumed, fresh = AheadOfTimeSource(p), QueueingWorkers()
    resumed.load_state_dict(state)
    fresh.version = 2  # the resumed trainer's first push: the checkpoint's weights
    versions = []
    for s in range(2, STEPS):
        versions.append(resumed.take(s, fresh, not_here, request).policy_versions[0])
        fresh.version = s + 1
    assert versions == [p.generating_version(s) for s in range(2, STEPS)] == [0, 1, 2, 3]
    assert fresh.submitted == [4, 5, 6, 7]  # 6 and 7: past the plan's end, for the last checkpoint


@pytest.mark.parametrize("k", [1, 2])
def test_a_finished_runs_last_checkpoint_keeps_k_steps_past_its_end_and_an_extended_run_goes_on_from_them(k):
    """Issue 36 item 5: extending a finished run (trainer.total_rollout_steps raised on resume). The steps past the
    plan's end were requested with the versions the schedule gives them, and the last checkpoint keeps them: the
    resumed source takes them and requests the rest with the versions its workers hold. (It used to request none past
    the end, and the extended run stopped: "rollout step 7 is due for policy version 5 but the workers hold
    version 6".)"""
    source, workers = AheadOfTimeSource(plan(k)), QueueingWorkers()
    for s in range(STEPS):
        source.take(s, workers, not_here, request)
        workers.version = s + 1
    source.collect(workers)  # the final checkpoint
    state = source.state_dict()
    assert sorted(state["prefetched"]) == list(range(STEPS, STEPS + k))

    longer = plan_of(256, rollout=RolloutConfig(mode="disaggregated", max_staleness=k), steps=STEPS + 2)
    resumed, fresh = AheadOfTimeSource(longer), QueueingWorkers()
    resumed.load_state_dict(state)
    fresh.version = STEPS  # the resumed trainer's first push: the checkpoint's weights
    versions = []
    for s in range(STEPS, STEPS + 2):
        versions.append(resumed.take(s, fresh, not_here, request).policy_versions[0])
        fresh.version = s + 1
    assert versions == [longer.generating_version(s) for s in range(STEPS, STEPS + 2)] == [STEPS - k, STEPS + 1 - k]
    assert fresh.submitted == list(range(STEPS + k, STEPS + 2 + k))


def test_a_schedule_that_does_not_hold_the_planned_version_stops():
    p = plan(1)
    source, workers = AheadOfTimeSource(p), QueueingWorkers()
    source.take(0, workers, not_here, request)
    workers.version = 5  # not the version step 2 is due for (1)
    with pytest.raises(RuntimeError, match="rollout step 2 is due for policy version 1 but the workers hold version 5"):
        source.take(1, workers, not_here, request)


def test_the_synchronous_source_generates_now_with_the_newest_version_and_keeps_nothing():
    source = SynchronousSource()
    generations = [Generation(0, [7], False, "", [-1.0])] * 3
    got = source.take(4, None, lambda: generations, request)
    assert got.generations == generations and got.policy_versions == [4, 4, 4] and got.wait_seconds is None
    assert source.state_dict() == {}


def test_the_plans_mode_picks_the_source():
    assert isinstance(source_for(plan(1)), AheadOfTimeSource)
    assert isinstance(source_for(plan_of(256, steps=STEPS)), SynchronousSource)


def test_the_data_module_never_asks_for_the_rollout_mode():
    """The mode is the source's: the data module reads no `mode` or `rollout_mode` (acceptance of issue 35)."""
    tree = ast.parse((ROOT / "lit_ppo/rollout/datamodule.py").read_text())
    asked = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("mode", "rollout_mode")]
    assert asked == []


def test_a_snapshot_at_a_steps_start_receives_nothing_and_a_dropped_step_is_taken_again():
    """Issue 36 item 4 at the source: at k = 2 the snapshot at step 1's start leaves step 2 in flight (the old snapshot
    received it: the pipeline was one step deep); step 1's take receives step 1 alone; after the step is dropped and
    the snapshot restored, a checkpoint keeps step 1 (taken, not yet trained) besides 2 and 3."""
    p = plan(2)
    source, workers = AheadOfTimeSource(p), QueueingWorkers()
    source.take(0, workers, not_here, request)
    workers.version = 1
    snapshot = source.snapshot()
    assert workers.collected == [0] and sorted(source.in_flight) == [1, 2]
    first = source.take(1, workers, not_here, request)
    assert workers.collected == [0, 1] and sorted(source.in_flight) == [2, 3]
    source.restore(snapshot)  # the step was dropped before its updates
    source.collect(workers)  # the checkpoint the preemption writes
    state = source.state_dict()
    assert sorted(state["prefetched"]) == [1, 2, 3]
    resumed, fresh = AheadOfTimeSource(p), QueueingWorkers()
    resumed.load_state_dict(state)
    fresh.version = 1
    again = resumed.take(1, fresh, not_here, request)
    assert (again.generations, again.policy_versions) == (first.generations, first.policy_versions)
    assert fresh.submitted == [] and fresh.collected == []


class SlowWorkers(QueueingWorkers):
    """Workers whose generation is slow, taking the data module's requests (a step's request, requested
    in order): a step is generated only when the trainer collects it (the test asserts on what was received, not on
    time)."""

    def submit(self, request):
        return super().submit(step_request(len(self.submitted), request.prompt_token_ids, request.n))


def test_the_data_modules_snapshot_does_not_wait_for_the_step_after_next(tiny_model_dir, arithmetic_files):
    """The data module that the preemption handler snapshots at each step's start (`Preemption.on_train_batch_start`):
    at k = 2 its snapshot at step 1 receives nothing (step 2 stays in flight), step 1's batch waits for step 1 alone,
    and a restored snapshot followed by a checkpoint gives a resumed data module the same batch of step 1."""
    from transformers import AutoTokenizer

    from lit_ppo.rollout.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = load_prompts(arithmetic_files[0], tokenizer)
    rollout = RolloutConfig(mode="disaggregated", max_staleness=2)
    p = plan_of(len(prompts), rollout=rollout, steps=4)

    def datamodule(workers):
        return datamodule_on(prompts, rollout, tokenizer, tiny_model_dir, workers, plan=p)

    workers = SlowWorkers()
    dm = datamodule(workers)
    dm.produce_rollout(0)
    workers.version = 1
    snapshot = dm.snapshot()
    assert workers.collected == [0] and sorted(dm.source.in_flight) == [1, 2]
    batch = dm.produce_rollout(1)
    assert workers.collected == [0, 1] and batch.policy_versions == [0] * len(batch.response_ids)
    dm.restore(snapshot)
    state = dm.state_dict()
    assert state["next_rollout_step"] == 1 and sorted(state["prefetched"]) == [1, 2, 3]

    fresh = SlowWorkers()
    resumed = datamodule(fresh)
    resumed.load_state_dict(state)
    again = resumed.produce_rollout(1)
    assert again.response_ids == batch.response_ids and again.dataset_indices == batch.dataset_indices
    assert fresh.submitted == [] and fresh.collected == []
