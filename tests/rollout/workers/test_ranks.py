"""Data-parallel trainers with rollout workers (lit_ppo/rollout/workers/ranks.py), on 2 gloo CPU processes with a client
that stands in for the workers' (`RolloutWorkers`) on rank 0: every rank receives rank 0's results, reads every tensor
of a push in rank 0's order, and stops with rank 0's one line when the workers fail. The real workers' runs are in
tests/end_to_end/test_ddp_workers.py (slow)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_ppo.contract import GenerateRequest, WeightUpdate
from lit_ppo.errors import ConfigError, RolloutWorkerError
from lit_ppo.rollout.schedule import AheadOfTimeSource
from lit_ppo.rollout.workers.ranks import DataParallelWorkers
from tests.helpers import compose_run_config
from tests.helpers.asynchronous import QueueingWorkers, not_here, plan, step_request
from tests.helpers.ranks import start_ranks


class PushedWorkers(QueueingWorkers):
    """QueueingWorkers that take pushes: the next requests generate with the version pushed last."""

    def update_weights(self, update: WeightUpdate) -> int:
        self.version = update.policy_version
        return sum(t.numel() * t.element_size() for _, t in update.tensors)


class FailingWorkers(QueueingWorkers):
    """A client whose worker died: its waits and pushes fail as RolloutWorkers' do (one line)."""

    LINE = "trainer: rollout worker 0 (pid 7) exited with code -9 while the trainer waited for rollout batch; see w.log"

    def __init__(self, fail_push_after: int | None = None):
        super().__init__()
        self.fail_push_after = fail_push_after
        self.read: list[str] = []

    def collect(self, ticket):
        raise RolloutWorkerError(self.LINE)

    def update_weights(self, update: WeightUpdate) -> int:
        for name, _ in update.tensors:
            self.read.append(name)
            if len(self.read) == self.fail_push_after:
                raise RolloutWorkerError("trainer: the weight push of version 1 (bucket 0, 0.0 MiB) did not complete")
        return 0


def request(step: int, round_in_step: int = 0) -> GenerateRequest:
    # 4 prompts, n = 2: rank 0's share is prompts 0-1, rank 1's prompts 2-3
    return step_request(step, [[1], [2], [3], [4]], n=2)


def on_two_ranks(rank: int, store_path: str, scenario: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        results[rank] = globals()[scenario](rank)
    except Exception:  # noqa: BLE001 - reported to the test
        results[rank] = ("raised", traceback.format_exc().strip().splitlines()[-1])
    finally:
        dist.destroy_process_group()


def schedule(rank: int):
    """k = 1 over 3 steps; each rank's share of each step and the source's state after a checkpoint's collect."""
    workers = DataParallelWorkers(PushedWorkers() if rank == 0 else None, rank, torch.device("cpu"))
    source, shares = AheadOfTimeSource(plan(1)), []
    workers.update_weights(WeightUpdate(0, tensors=iter([("w", torch.ones(2))])))  # on_train_start's push
    for step in range(3):
        got = source.take(step, workers, not_here, request, share=range(2 * rank, 2 * rank + 2))
        shares.append(([g.prompt_index for g in got.generations], [g.token_ids[0] for g in got.generations]))
        workers.update_weights(WeightUpdate(step + 1, tensors=iter([("w", torch.ones(2))])))
    source.collect(workers)
    state = source.state_dict()
    return shares, {step: len(g) for step, (g, _, _) in state["prefetched"].items()}, workers.version


def collect_fails(rank: int):
    workers = DataParallelWorkers(FailingWorkers() if rank == 0 else None, rank, torch.device("cpu"))
    workers.collect(workers.submit(step_request(0, [[1]], n=1)))


def push_fails(rank: int):
    """Rank 0's push fails at the second tensor; every rank still reads all three (FSDP's gathers meet)."""
    read: list[str] = []

    def tensors():
        for name in ("a", "b", "c"):
            read.append(name)
            yield name, torch.zeros(1)

    workers = DataParallelWorkers(FailingWorkers(fail_push_after=2) if rank == 0 else None, rank, torch.device("cpu"))
    try:
        workers.update_weights(WeightUpdate(1, tensors=tensors()))
    except RolloutWorkerError as error:
        return read, str(error)
    return read, None


def evaluation(rank: int):
    """Each rank's own prompts generated (rank 1 has none), its results only."""
    workers = DataParallelWorkers(QueueingWorkers() if rank == 0 else None, rank, torch.device("cpu"))
    prompts = [[5], [6], [7]] if rank == 0 else []
    return [g.prompt_index for g in workers.generate(step_request(9, prompts, n=1))]


def run_on_two_ranks(tmp_path: Path, scenario: str) -> dict:
    results = mp.Manager().dict()
    start_ranks(on_two_ranks, 2, str(tmp_path / "store"), scenario, results)
    return dict(results)


def test_every_rank_receives_the_whole_step_and_takes_its_share(tmp_path):
    results = run_on_two_ranks(tmp_path, "schedule")
    for rank in (0, 1):
        shares, prefetched, version = results[rank]
        for step, (indices, steps) in enumerate(shares):
            # Its two prompts, n = 2 each, counted from its share's first, of the step requested for it.
            assert indices == [0, 0, 1, 1] and steps == [step] * 4
        assert prefetched == {3: 8} and version == 3  # step 3, requested ahead: the whole step (4 prompts x 2)
    assert results[0][1] == results[1][1]


def test_a_failure_on_rank_0_stops_every_rank_with_its_line(tmp_path):
    results = run_on_two_ranks(tmp_path, "collect_fails")
    assert results[0] == results[1] == ("raised", f"lit_ppo.errors.RolloutWorkerError: {FailingWorkers.LINE}")


def test_a_failed_push_still_reads_every_tensor_on_every_rank_then_stops_them(tmp_path):
    results = run_on_two_ranks(tmp_path, "push_fails")
    for rank in (0, 1):
        read, error = results[rank]
        assert read == ["a", "b", "c"]
        assert error.startswith("trainer: the weight push of version 1")


def test_evaluation_gives_each_rank_its_own_prompts_results(tmp_path):
    assert run_on_two_ranks(tmp_path, "evaluation") == {0: [0, 1, 2], 1: []}


def test_a_collective_timeout_shorter_than_the_workers_waits_is_refused_in_one_line():
    """Ranks 1.. wait for rank 0 in a collective while it waits for the workers: their wait must be the longer."""
    ddp = ["rollout.mode=disaggregated", "strategy=ddp", "strategy.devices=2", "strategy.accelerator=cpu"]
    match = (
        r"^trainer.collective_timeout_s=300 with 2 trainer ranks and rollout workers: .*"
        r"rollout.workers.batch_timeout_s=900 s .*fix: trainer.collective_timeout_s above 900"
    )
    with pytest.raises(ConfigError, match=match) as info:
        compose_run_config(*ddp, "trainer.collective_timeout_s=300", "rollout.workers.batch_timeout_s=900")
    assert "\n" not in str(info.value)
    compose_run_config(*ddp)  # the defaults: 1800 s against 600 s
    compose_run_config("rollout.mode=disaggregated", "trainer.collective_timeout_s=300")  # one rank: no collective
