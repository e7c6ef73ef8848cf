"""A context-parallel group's rollouts (issue 51, strategy.context_parallel_size = C > 1): the C ranks of a group train
one data-parallel rank's samples, so rank 0 of the group alone generates and scores them, and broadcasts the rollout
batch to the group's other ranks (`shared_by_group`, over the group's process group), which train the identical batch
and generate nothing. A reward that is not deterministic (code execution, a judge, anything timed) or a sampler whose
last bits differ between devices then cannot split a group, and generation and rewards run once, not C times. The
held-out evaluation is shared the same way.

Failures stop the whole group together: what rank 0 raised (a preemption, a shortfall of dynamic sampling, a reward's
error) is broadcast in place of the batch and raised again on the other ranks, so that the exception's own handling
(an exception checkpoint: a collective over every rank) meets. While rank 0 generates, its stop points agree with the
other generating ranks only (its data-parallel group, `preemption.agreeing_among`); the others wait in the broadcast.

The other ranks' engine (`FollowerEngine`) generates nothing. It still takes every weight sync's tensors, unread, in
order: under FSDP each is gathered from every rank (a collective). Where the engine's start is itself a collective
(`EngineRow.starts_on_every_rank`: colocated vLLM's external_launcher creates its process groups over every rank) the
real engine is started too and put to sleep at once (its memory freed where vLLM's sleep mode is on); otherwise
(rollout.engine=hf) nothing starts.
"""

from __future__ import annotations

import pickle
from typing import Callable, TypeVar

from lit_ppo.contract import GenerateRequest, Generation, RolloutEngine, WeightUpdate
from lit_ppo.distributed import broadcast_object
from lit_ppo.engine_registry import engine_row
from lit_ppo.preemption import Preempted, agreeing_among

T = TypeVar("T")


class FollowerEngine:
    """The engine of a context-parallel rank other than its group's rank 0 (module docstring): an engine of the
    contract that never generates; `inner`, where one had to start, is kept asleep."""

    adapter_version = 0

    def __init__(self, inner: RolloutEngine | None = None):
        self.inner = inner
        if inner is not None:
            inner.sleep()

    def generate(self, request: GenerateRequest) -> list[Generation]:
        raise RuntimeError(
            "FollowerEngine: a context-parallel group's rank 0 generates its samples; this rank receives them "
            "(lit_ppo/rollout/context_group.py)"
        )

    def update_weights(self, update: WeightUpdate) -> int:
        for _ in update.tensors or ():  # read as rank 0's engine reads them: FSDP gathers each from every rank
            pass
        return 0

    def sleep(self) -> None:
        pass  # asleep from the start

    def wake_up(self) -> None:
        pass  # never generates

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def follower_engine(datamodule) -> FollowerEngine:
    """The engine of a rank that does not generate: the run's engine started too where its start is a collective."""
    row = engine_row(datamodule.rollout.engine, datamodule.plan)
    starts = row.starts_on_every_rank and datamodule.topology.distributed
    return FollowerEngine(datamodule.source.start_engine(datamodule) if starts else None)


def generates(topology) -> bool:
    """Whether this rank generates and scores its samples: every rank with C = 1, a group's rank 0 with C > 1."""
    return topology.context_parallel_rank == 0


def shared_by_group(topology, device, produce: Callable[[], T]) -> T:
    """`produce()` on the group's rank 0 (C = 1: on every rank), its result (or what it raised) broadcast to the group's
    other ranks, which return it (or raise it) in turn: a collective over the context-parallel group."""
    if topology.context_parallel_group is None:
        return produce()
    group = topology.context_parallel_group
    if not generates(topology):
        failed, result = broadcast_object(None, device, group=group)
        if failed:
            raise _raised(result)
        return result
    try:
        with agreeing_among(None):  # the generating ranks: this rank's data-parallel group
            result = produce()
    except BaseException as error:
        broadcast_object((True, _portable(error)), device, group=group)
        raise
    try:
        broadcast_object((False, result), device, group=group)
    except Exception as error:  # the batch did not pickle (before anything was sent): the group's other ranks raise too
        broadcast_object((True, _portable(error)), device, group=group)
        raise
    return result


def _portable(error: BaseException):
    """What the other ranks raise for `error`: a preemption as its signal, another error itself where it comes back
    from pickle as it was (its type and message), else a RuntimeError of its type and message."""
    if isinstance(error, Preempted):
        return ("preempted", error.signum)
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:
        pass
    return RuntimeError(f"rank 0 of this rank's context-parallel group stopped: {type(error).__name__}: {error}")


def _raised(sent) -> BaseException:
    if isinstance(sent, tuple):
        return Preempted(sent[1])
    return sent
