"""The rollout schedule: which policy version generates which rollout step, what is in flight, what has been received.

The data module asks its source for each generation round's samples and never asks which source it holds:

- `SynchronousSource` (rollout.mode=colocated): the round is generated now, in this process, by an engine that holds
  the newest weights, so every sample is of policy version `rollout_step`.
- `AheadOfTimeSource` (rollout.mode=disaggregated): rollout step s is requested from the rollout workers right after
  the push of the version the plan's schedule gives it (`StepPlan.generating_version`: max(0, s - max_staleness)), so
  the workers generate up to k steps ahead while the trainer trains; a round only waits for its step's results,
  received in order, and the workers' versions are checked against the plan before each request. With dynamic
  sampling a step is requested with the plan's `rounds_requested_ahead` rounds, and its refill rounds (those beyond,
  which its rewards call for) are requested when the step is taken, from the workers' newest version: the step's own.

What a source keeps across a checkpoint is declared in the `state_dict` it contributes to the data module's; only a
real checkpoint waits for what is in flight (`collect`): the snapshot a preemption takes at each step's start
(`snapshot`/`restore`) does not, so that at k >= 2 the trainer never waits on step s + 1 at the start of step s.
`source_for` is the one place that picks a source from the plan's rollout mode.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from lit_ppo.contract import Generation, RolloutEngine
from lit_ppo.engine_registry import start_engine
from lit_ppo.plan import StepPlan
from lit_ppo.preemption import interruptibly


@dataclass(frozen=True)
class ScheduledRound:
    """One generation round's samples (prompt by prompt, n each) and where they came from."""

    generations: list[Generation]
    policy_versions: list[int]  # per sample: the policy version (optimizer steps' rollout steps) that generated it
    generate_seconds: float  # what generating them took (the workers' longest share when they generated ahead)
    wait_seconds: float | None  # what the trainer waited for them; None where it generated them itself


class RolloutSource(Protocol):
    """Where the data module's generation rounds come from."""

    requests_ahead: bool
    """Whether the rounds it takes were requested before (kept by the source, in flight or received, through a dropped
    step and a checkpoint), rather than generated when taken."""

    interruptible: bool
    """Whether a preemption signal may cut this source's generation in this process (lit_ppo.preemption): not where
    the rollout workers generate (their requests stay in their ordered queues) nor where a tensor-parallel engine
    runs collectives inside generate."""

    def start_engine(self, datamodule) -> RolloutEngine:
        """The engine this source generates with, started from the settings of `datamodule` (a RolloutDataModule:
        not imported here, which imports this module) by the engine registry's one factory."""
        ...

    def take(
        self,
        rollout_step: int,
        engine: RolloutEngine,
        generate: Callable[[], list[Generation]],
        request: Callable[[int, int], object],
        round_in_step: int = 0,
        share: range | None = None,
    ) -> ScheduledRound | None:
        """Round `round_in_step` (0: the first) of `rollout_step`: `generate()` generates this rank's round now;
        `request(step, round_in_step)` gives the request of one round of a rollout step (every rank's prompts: a
        `GenerateRequest`, or the episodes' `EpisodeRequest`); `share`: this rank's prompt positions in it (None: all). None: a preemption signal dropped the round
        (the caller passes a stop point next)."""
        ...

    def now(self, rollout_step: int, engine: RolloutEngine, request) -> ScheduledRound | None:
        """`request` generated now, by the newest version the engine holds (`rollout_step`'s own; partial rollouts'
        fill chunks), behind what it has queued. None: a preemption signal dropped it."""
        ...

    def request_next(self, step: int, engine: RolloutEngine, request: Callable[[int, int], object]) -> None:
        """Request rollout step `step` now where the schedule generates it ahead (rollout workers at k >= 1) and it is
        not yet requested: partial rollouts' next chunk, which continues what the step before left in flight, so it
        can only be requested once that step is taken (`request(step, 0)`: its request)."""
        ...

    def collect(self, engine: RolloutEngine | None) -> None:
        """Receive whatever is in flight from `engine`: a real checkpoint keeps it (the versions that generated it are
        gone by the time a resumed run would need it)."""
        ...

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this source (merged into the data module's state); nothing may be in flight."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def snapshot(self) -> dict:
        """Where the source stands at a rollout step's start, without waiting for anything."""
        ...

    def restore(self, snapshot: dict) -> None:
        """Back to `snapshot` after the step begun there was dropped (lit_ppo.preemption)."""
        ...


class SynchronousSource:
    """rollout.mode=colocated: each round generated now, in this process, with the newest weights (version
    `rollout_step`). Nothing is ahead, so nothing is kept."""

    requests_ahead = False

    def __init__(self, interruptible: bool = True):
        # Tensor-parallel engines run collectives inside generate: only the end of their round is a stop point.
        self.interruptible = interruptible

    def start_engine(self, datamodule) -> RolloutEngine:
        return start_engine(datamodule)  # the engine of rollout.engine in this process (lit_ppo/engine_registry.py)

    def rounds_ahead_of(self, rollout_step: int) -> int | None:
        return None  # nothing is requested ahead

    def take(self, rollout_step, engine, generate, request, round_in_step=0, share=None) -> ScheduledRound | None:
        started = time.perf_counter()
        generations = interruptibly(generate) if self.interruptible else generate()
        if generations is None:
            return None
        seconds = time.perf_counter() - started
        return ScheduledRound(generations, [rollout_step] * len(generations), seconds, wait_seconds=None)

    def now(self, rollout_step, engine, request) -> ScheduledRound | None:
        return self.take(rollout_step, engine, lambda: engine.generate(request), None)

    def request_next(self, step, engine, request) -> None:
        pass  # each step generated when taken

    def collect(self, engine) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def snapshot(self) -> dict:
        return {}

    def restore(self, snapshot: dict) -> None:
        pass


@dataclass(frozen=True)
class Received:
    """A rollout step's results from the workers: generations in prompt order, each one's policy version, and the
    workers' longest generation seconds."""

    generations: list[Generation]
    policy_versions: list[int]
    worker_seconds: float


class AheadOfTimeSource:
    """rollout.mode=disaggregated: rollout steps requested from the rollout workers up to `max_staleness` steps ahead
    of the one the trainer needs, each right after the push of the version the plan gives it, received in order.

    State: `in_flight` (steps requested, not yet received: per round the workers' tickets, which no checkpoint can
    keep), `received` (steps received, per round, from the one being trained on; what a checkpoint keeps of those from
    `next_step` on, after collecting), and the cursor `next_step` (the step the trainer takes next). The next step to
    request follows the last one known of in flight and received (or the step the trainer needs). Each step is
    requested with `rounds_ahead` rounds (1 without dynamic sampling); a refill round is requested when taken and kept
    nowhere (a step taken again requests it again, from the same version: the step's own)."""

    interruptible = False  # the workers' queues are not this process's to cut
    requests_ahead = True

    def __init__(self, plan: StepPlan):
        self.plan = plan
        self.in_flight: dict[int, list[list]] = {}  # step -> per round, the workers' tickets
        self.received: dict[int, list[Received]] = {}  # step -> per round
        self.next_step = 0
        # Steps requested ahead when one is taken: k; with partial rollouts none (each step's chunk continues the
        # previous one's, `request_next`, so the workers are at most one step ahead: k <= 1, config/partial.py).
        self.ahead = 0 if plan.partial is not None else plan.max_staleness

    @property
    def rounds_ahead(self) -> int:
        """The generation rounds each rollout step is requested with: the plan's (dynamic sampling), else 1."""
        ds = self.plan.dynamic_sampling
        return ds.rounds_requested_ahead if ds is not None and ds.rounds_requested_ahead else 1

    def start_engine(self, datamodule) -> RolloutEngine:
        return start_engine(datamodule)  # the rollout workers' client of the run's launch (lit_ppo/engine_registry.py)

    def take(self, rollout_step, engine, generate, request, round_in_step=0, share=None) -> ScheduledRound:
        """Round 0 first requests every step up to rollout_step + k not yet requested (partial rollouts: none ahead,
        `request_next`) (`rounds_ahead`
        rounds each): the workers hold version `rollout_step` now (pushed after the previous step), which the schedule
        gives to step rollout_step + k and, at the start, to steps 0..k; the steps before were requested after their
        own versions' pushes (past the plan's end too: the last checkpoint keeps them for a run extended on resume).
        Then it waits for `rollout_step`'s results (bounded by the workers' timeouts). A round
        requested ahead is taken from those; a later one (dynamic sampling's refill) is requested now, behind what the
        workers have queued, from the version they hold: `rollout_step`, as the plan states. `request(step, round)` is
        the whole round (every rank's prompts) and is received whole on every rank, so that the ranks' checkpoint
        states are one; `share` (this rank's prompt positions in the round; None: all) is what this rank is given, its
        prompt indices counted from the share's first."""
        started = time.perf_counter()
        if round_in_step > 0 and round_in_step >= self.rounds_ahead_of(rollout_step):
            self.check_version(rollout_step, round_in_step, engine, self.rounds_ahead_of(rollout_step))
            got = Received(*engine.collect(engine.submit(request(rollout_step, round_in_step))))
            return share_of(got, share, wait_seconds=time.perf_counter() - started)
        if round_in_step == 0:
            # Past the plan's end too: the last checkpoint then keeps the k steps after it, generated by the versions
            # the schedule gives them, and a run extended on resume (trainer.total_rollout_steps raised) takes them
            # from there.
            last = rollout_step + self.ahead
            for step in range(max(set(self.in_flight) | set(self.received) | {rollout_step - 1}) + 1, last + 1):
                self.check_version(step, 0, engine)
                self.in_flight[step] = [engine.submit(request(step, j)) for j in range(self.rounds_ahead)]
            self.receive(engine, upto=rollout_step)
            # The step taken stays received until the next one is taken: a dropped step is taken again (`restore`).
            self.received = {step: r for step, r in self.received.items() if step >= rollout_step}
            self.next_step = rollout_step + 1
        return share_of(self.received[rollout_step][round_in_step], share, wait_seconds=time.perf_counter() - started)

    def now(self, rollout_step, engine, request) -> ScheduledRound:
        started = time.perf_counter()
        got = Received(*engine.collect(engine.submit(request)))
        return share_of(got, None, wait_seconds=time.perf_counter() - started)

    def request_next(self, step, engine, request) -> None:
        if self.plan.max_staleness == 0 or step in self.in_flight or step in self.received:
            return  # k = 0: generated by the version pushed after the step before, when taken; or requested already
        self.check_version(step, 0, engine)
        self.in_flight[step] = [engine.submit(request(step, 0))]

    def rounds_ahead_of(self, rollout_step: int) -> int:
        """The rounds `rollout_step` was requested ahead with: the plan's, or as many as a checkpoint kept where it was
        written under other dynamic sampling settings (ppo.dynamic_sampling.max_generation_rounds raised on resume, as
        a shortfall's error advises): rounds beyond them are refill rounds, requested when they are needed from
        version s (the versions that would have requested them ahead are gone)."""
        return len(self.received[rollout_step]) if rollout_step in self.received else self.rounds_ahead

    def check_version(self, step: int, round_in_step: int, engine, rounds_ahead: int | None = None) -> None:
        """The workers hold the version the plan gives this round of `step` (checked before each request)."""
        due = self.plan.generating_version(step, round_in_step, rounds_ahead)
        if due != engine.version:
            raise RuntimeError(  # the schedule's own bookkeeping, not a setting: check_policy_versions proves it
                f"rollout step {step}"
                + (f" (generation round {round_in_step + 1})" if round_in_step else "")
                + f" is due for policy version {due} but the workers hold version {engine.version}"
            )

    def receive(self, engine, upto: int | None = None) -> None:
        """Move the requested steps (those up to `upto`; all: None) from in flight to received, waiting for them."""
        for step in sorted(self.in_flight):
            if upto is None or step <= upto:
                self.received[step] = [Received(*engine.collect(t)) for t in self.in_flight.pop(step)]

    def collect(self, engine) -> None:
        self.receive(engine)

    def state_dict(self) -> dict:
        # The steps generated ahead, by policy versions a resumed run no longer has: kept (received first, by the
        # data module's `collect`), so that a resume trains on exactly the samples an uninterrupted run would.
        # ("prefetched": the key that checkpoints have always had, a step's first round; "prefetched_rounds": the
        # further rounds requested ahead with dynamic sampling.)
        if self.in_flight:
            raise RuntimeError(
                f"AheadOfTimeSource.state_dict: rollout steps {sorted(self.in_flight)} are in flight; collect them first"
            )

        def kept(r: Received) -> tuple:
            return [dataclasses.asdict(g) for g in r.generations], r.policy_versions, r.worker_seconds

        steps = {step: rounds for step, rounds in self.received.items() if step >= self.next_step}
        state = {"prefetched": {step: kept(rounds[0]) for step, rounds in steps.items()}}
        more = {step: [kept(r) for r in rounds[1:]] for step, rounds in steps.items() if len(rounds) > 1}
        return {**state, "prefetched_rounds": more} if more else state

    def load_state_dict(self, state: dict) -> None:
        def round_of(kept) -> Received:
            gens, versions, seconds = kept
            return Received([generation_of(g) for g in gens], list(versions), float(seconds))

        more = {int(step): rounds for step, rounds in state.get("prefetched_rounds", {}).items()}
        self.received = {
            int(step): [round_of(first), *(round_of(r) for r in more.get(int(step), []))]
            for step, first in state.get("prefetched", {}).items()
        }
        self.next_step = min(self.received, default=0)  # a checkpoint keeps none before the cursor

    def snapshot(self) -> dict:
        # Nothing is received here: what is in flight stays in flight (the requests cannot be taken back, and are
        # what a resumed run would request with the same versions), and the steps taken since stay received.
        return {"next_step": self.next_step}

    def restore(self, snapshot: dict) -> None:
        self.next_step = snapshot["next_step"]


def generation_of(fields: dict) -> Generation:
    """A kept generation back from its fields: an episode (multi-turn, with its mask) or a single-turn response."""
    from lit_ppo.rollout.episodes import Episode

    return Episode(**fields) if "policy_mask" in fields else Generation(**fields)


def share_of(got: Received, share: range | None, wait_seconds: float) -> ScheduledRound:
    """This rank's part of a round received whole: the generations of the prompts at positions `share` (None: all),
    their prompt indices counted from the share's first."""
    generations, versions = got.generations, got.policy_versions
    if share is not None:
        mine = [i for i, g in enumerate(generations) if g.prompt_index in share]
        generations = [
            dataclasses.replace(generations[i], prompt_index=generations[i].prompt_index - share.start) for i in mine
        ]
        versions = [versions[i] for i in mine]
    return ScheduledRound(generations, versions, got.worker_seconds, wait_seconds=wait_seconds)


def source_for(plan: StepPlan | None, tensor_parallel_size: int = 1) -> RolloutSource:
    """The source of the plan's rollout mode: generated now (colocated) or requested ahead (disaggregated). Without a
    plan (a data module built only to evaluate): generated now."""
    if plan is not None and plan.workers:
        return AheadOfTimeSource(plan)
    return SynchronousSource(interruptible=tensor_parallel_size == 1)
