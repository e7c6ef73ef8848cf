"""What a context-parallel group (issue 51, strategy.context_parallel_size = C > 1) computes once: its rank 0 alone
runs it and broadcasts the result, or what it raised, to the group's other ranks (`shared_by_group`, over the group's
process group), which return it or raise it in turn. The C ranks of a group train one data-parallel rank's samples, so
whatever feeds their loss must be the same on each: the rollout batch and the held-out evaluation
(lit_ppo/rollout/context_group.py), and a server teacher's log-probs (lit_ppo/training/teacher.py). A reward that is not
deterministic, a sampler or a server whose last bits differ between calls then cannot split a group, and the work runs
once, not C times.

Failures stop the whole group together: what rank 0 raised (a preemption, a shortfall of dynamic sampling, a reward's
or a server's error) is broadcast in place of the result and raised again on the other ranks, so that the exception's
own handling (an exception checkpoint: a collective over every rank) meets. While rank 0 produces, its stop points
agree with the other producing ranks only (its data-parallel group, `preemption.agreeing_among`); the others wait in
the broadcast.
"""

from __future__ import annotations

import pickle
from typing import Callable, TypeVar

from lit_ppo.distributed import broadcast_object
from lit_ppo.preemption import Preempted, agreeing_among

T = TypeVar("T")


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
