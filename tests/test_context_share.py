"""What a context-parallel group computes once (lit_ppo/context_share.py): the group's rank 0 alone produces it and
broadcasts it, or what it raised, to the group's other ranks; its stop points agree with the other producing ranks
only. Four gloo ranks, C = 2 (groups {0, 1} and {2, 3}; producing ranks 0 and 2). Its uses: the rollout batch
(tests/rollout/test_context_group.py, the whole rollout step in tests/training/test_context_parallel.py) and a server
teacher's log-probs (tests/training/test_teacher_server.py)."""

from __future__ import annotations

import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.ranks import start_ranks


def _outcome(topology, produce) -> tuple[str, str]:
    """('returned', the value) or (the type of what was raised, its message) of `shared_by_group` on this rank."""
    from lit_ppo.context_share import shared_by_group

    try:
        return "returned", repr(shared_by_group(topology, torch.device("cpu"), produce))
    except BaseException as raised:  # noqa: BLE001 - Preempted is a SystemExit
        detail = raised.signum if type(raised).__name__ == "Preempted" else str(raised)
        return type(raised).__name__, str(detail)


def on_four_ranks(rank: int, store_path: str, results: dict) -> None:
    from lit_ppo.errors import DynamicSamplingShortfallError
    from lit_ppo.preemption import Preemption, stop_point
    from lit_ppo.topology import RankTopology

    # a stop point that waited for the ranks in the broadcast would fail here within seconds, not hang the suite
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=4, timeout=timedelta(seconds=20)
    )
    try:
        topology = RankTopology(rank=rank, world_size=4, context_parallel_size=2).with_groups()
        handler = Preemption(checkpoints=None)
        handler._topology, Preemption._active = topology, handler
        produced = []

        def rank_and_time():  # a reward of this rank and this moment: each rank's own would differ
            produced.append(rank)
            return (rank, time.time())

        outcome = {"value": _outcome(topology, rank_and_time)}

        def short():
            raise DynamicSamplingShortfallError("rollout step 1: 3 of 4 prompt groups had differing rewards")

        outcome["shortfall"] = _outcome(topology, short)
        handler.requested = signal.SIGTERM if rank == 2 else None  # the signal reached one generating rank only

        def generate_then_stop():
            stop_point(torch.device("cpu"))  # agreed among the generating ranks 0 and 2
            return "not preempted"

        outcome["preempted"] = _outcome(topology, generate_then_stop)
        handler.requested = None

        class LocalError(Exception):  # a class pickle cannot find by name
            pass

        def unpicklable():
            raise LocalError("the judge's socket closed")

        outcome["unpicklable"] = _outcome(topology, unpicklable)
        outcome["produced"] = produced
        results[rank] = outcome
    except Exception:  # noqa: BLE001 - reported to the test
        results[rank] = traceback.format_exc()
    finally:
        Preemption._active = None
        dist.destroy_process_group()


def test_a_group_s_rank_0_produces_and_every_rank_of_the_group_returns_or_raises_its_outcome(tmp_path: Path):
    results = mp.Manager().dict()
    start_ranks(on_four_ranks, 4, str(tmp_path / "store"), results)
    outcomes = [results[rank] for rank in range(4)]
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, dict), outcome
        first = rank // 2 * 2  # the group's rank 0
        # rank 0's (rank, time), the same object on the group's other rank, which produced nothing
        assert outcome["value"] == outcomes[first]["value"] and outcome["value"][1].startswith(f"({first}, ")
        assert outcome["produced"] == ([rank] if rank == first else [])
        assert outcome["shortfall"] == (
            "DynamicSamplingShortfallError",
            "rollout step 1: 3 of 4 prompt groups had differing rewards",
        )
        # SIGTERM on rank 2 alone: ranks 0 and 2 agree at the stop point, ranks 1 and 3 stop with their rank 0
        assert outcome["preempted"] == ("Preempted", str(int(signal.SIGTERM)))
        expected = "the judge's socket closed"
        if rank != first:
            expected = f"rank 0 of this rank's context-parallel group stopped: LocalError: {expected}"
        assert outcome["unpicklable"] == ("LocalError" if rank == first else "RuntimeError", expected)
