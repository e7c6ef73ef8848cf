"""The rollout schedule (lit_ppo/rollout/schedule.py): which policy version generates which rollout step, what is in
flight and what was received, driven as the trainer drives it; and the data module, which never asks for the mode."""

from __future__ import annotations

import ast

import pytest

from lit_ppo.config import RolloutConfig
from lit_ppo.contract import Generation
from lit_ppo.rollout.schedule import AheadOfTimeSource, SynchronousSource, source_for
from tests.helpers import ROOT, plan_of

STEPS = 6


class QueueingWorkers:
    """Stands in for the rollout workers' client (`RolloutWorkers`): each request is generated with the version pushed
    last before it (the workers' ordered commands), and its results are handed out when collected."""

    def __init__(self):
        self.version = 0  # the last version pushed
        self.submitted: list[int] = []  # rollout steps, in the order requested
        self.collected: list[int] = []  # rollout steps, in the order received

    def submit(self, prompt_token_ids, *, step, n):
        self.submitted.append(step)
        return (step, self.version, len(prompt_token_ids) * n)

    def collect(self, ticket):
        step, version, samples = ticket
        self.collected.append(step)
        generations = [Generation(i // 2, [step, i], False, "", [-1.0, -1.0]) for i in range(samples)]
        return generations, [version] * samples, 0.5


def request(step: int) -> dict:
    return {"prompt_token_ids": [[1, 2], [3]], "step": step, "n": 2}


def not_here():
    raise AssertionError("a source that generates ahead never generates in this process")


def plan(k: int):
    return plan_of(256, rollout=RolloutConfig(mode="disaggregated", max_staleness=k), steps=STEPS)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_each_step_is_requested_k_ahead_after_its_versions_push_and_received_in_order(k):
    """At step s the requests reach s + k (no further than the plan's end), each made while the workers hold the
    version the plan gives it; only s is received; every sample is of the plan's version."""
    p = plan(k)
    source, workers = AheadOfTimeSource(p), QueueingWorkers()
    for s in range(STEPS):
        got = source.take(s, workers, not_here, request)
        assert workers.submitted == list(range(min(s + k, STEPS - 1) + 1))
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
    assert fresh.submitted == [4, 5]


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
