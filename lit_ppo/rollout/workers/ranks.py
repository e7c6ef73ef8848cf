"""Data-parallel trainers with rollout workers (strategy=ddp or fsdp, rollout.mode=disaggregated): trainer rank 0 drives
the workers, every rank gets the results.

`DataParallelWorkers` is each rank's engine of the contract. On rank 0 it holds the workers' client
(`RolloutWorkers`): it alone submits requests, collects results and pushes weights; the other ranks hold none. Every
call is a collective of the trainer's process group, made by every rank in the same order:

- `submit` / `collect`: rank 0 requests a whole rollout step (every rank's prompts: the schedule requests steps ahead
  for the run, not for a rank) and broadcasts the step's results, so every rank receives the same whole step and keeps
  the same checkpoint state (lit_ppo/rollout/schedule.py takes each rank's share of it).
- `generate` (evaluation): each rank's request is gathered on rank 0, which submits them all, and each rank gets its own
  results.
- `update_weights`: every rank reads the update (under FSDP reading a tensor gathers it whole from the shards, one
  tensor at a time, and the probe's forward gathers each layer: collectives), rank 0 streams it to the workers in
  buckets as it reads and the others drop each tensor as soon as it was gathered, so the whole model is never held at
  once. The version is pushed once, by rank 0.

A failure of the workers (a dead worker, a timeout, a stuck push) is raised on rank 0 and broadcast: every rank stops
with the same one line (RolloutWorkerError), none waits for rank 0 until the process group's timeout.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from lit_ppo.contract import CountedTensors, GenerateRequest, Generation, WeightUpdate
from lit_ppo.distributed import all_gather_objects, broadcast_object
from lit_ppo.errors import RolloutWorkerError
from lit_ppo.rollout.episodes import EpisodeRequest
from lit_ppo.topology import DRIVER_RANK


class DataParallelWorkers:
    """One trainer rank's side of the rollout workers under data parallelism (module docstring). `workers`: the
    client on rank 0, None on the others (`start` builds it there)."""

    def __init__(self, workers, rank: int, device: torch.device):
        if (workers is not None) != (rank == DRIVER_RANK):
            raise ValueError("DataParallelWorkers: the workers' client lives on rank 0 and only there")
        self.workers, self.rank, self.device = workers, rank, device
        self.version: int | None = None  # the last version pushed
        self.pushed_adapter_version = 0

    @classmethod
    def start(cls, rank: int, device: torch.device, start_workers) -> "DataParallelWorkers":
        """Rank 0 starts the workers (`start_workers()`); every rank learns whether they started, so that a failed
        start stops each one with rank 0's line (a collective)."""
        workers, failure = None, None
        if rank == DRIVER_RANK:
            try:
                workers = start_workers()
            except Exception as error:  # noqa: BLE001 - sent to every rank, then raised as it was on rank 0
                failure = error
        cls._agree(failure, rank, device)
        return cls(workers, rank, device)

    @staticmethod
    def _agree(failure: BaseException | None, rank: int, device: torch.device, result=None):
        """Rank 0's result (or its failure's line) on every rank: raises the failure everywhere."""
        if failure is None:
            message = ("ok", result)
        elif isinstance(failure, RolloutWorkerError):
            message = ("error", str(failure))
        else:
            message = ("error", f"trainer rank 0: {type(failure).__name__}: {failure}")
        sent = broadcast_object(message, device)
        if failure is not None:
            raise failure
        status, value = sent
        if status == "error":
            raise RolloutWorkerError(value)
        return value

    @property
    def driver(self) -> bool:
        return self.rank == DRIVER_RANK

    @property
    def adapter_version(self) -> int:
        return self.pushed_adapter_version

    def _on_driver(self, call):
        """`call()` on rank 0, its result on every rank (a collective)."""
        result, failure = None, None
        if self.driver:
            try:
                result = call()
            except Exception as error:  # noqa: BLE001 - sent to every rank, then raised as it was on rank 0
                failure = error
        return self._agree(failure, self.rank, self.device, result)

    # ------------------------------------------------------------ generation

    def submit(self, request: GenerateRequest | EpisodeRequest):
        """Rank 0 queues the request with the workers (its tickets); the other ranks hold no ticket (None). Not a
        collective: every rank then calls `collect` in the same order."""
        return self.workers.submit(request) if self.driver else None

    def collect(self, ticket) -> tuple[list[Generation], list[int], float]:
        """The results of a `submit`, on every rank (a collective)."""
        return self._on_driver(lambda: self.workers.collect(ticket))

    def generate(self, request: GenerateRequest | EpisodeRequest) -> list[Generation]:
        """Each rank's own prompts generated by the workers (evaluation): the ranks' requests go to rank 0, which
        submits each (behind what the workers have queued) and hands each rank its results (a collective: a rank with
        no prompts calls it too, with none)."""
        requests = all_gather_objects(request)

        def generate_all() -> list[list[Generation]]:
            tickets = [self.workers.submit(r) if r.prompt_count else None for r in requests]
            return [self.workers.collect(t)[0] if t is not None else [] for t in tickets]

        return self._on_driver(generate_all)[self.rank]

    # ------------------------------------------------------------ weights

    @torch.no_grad()
    def update_weights(self, update: WeightUpdate) -> int:
        """Every rank reads the update in the same order (the probe's forward, then each tensor: under FSDP each a
        gather of the shards); rank 0 pushes it to the workers as it reads, the others drop what they read. Returns
        the bytes pushed (the same number on every rank)."""
        probe = update.probe() if update.probe is not None else None
        if update.adapter is not None:  # gathered whole already (`adapter_tensors`, a collective on every rank)
            pushed = WeightUpdate(update.policy_version, adapter=update.adapter, probe=lambda: probe)
            moved = self._on_driver(lambda: self.workers.update_weights(pushed))
            self.pushed_adapter_version = update.adapter.adapter_version
        else:
            tensors = iter(CountedTensors(update.tensors))
            if not self.driver:
                self._drain(tensors)  # each tensor gathered (FSDP: with rank 0's push) and dropped
            pushed = WeightUpdate(update.policy_version, tensors=tensors, probe=lambda: probe, metadata=update.metadata)
            moved = self._on_driver(lambda: self._push_then_drain(pushed, tensors))
        self.version = update.policy_version
        return moved

    def _push_then_drain(self, update: WeightUpdate, tensors: Iterator) -> int:
        """Rank 0's push; when it fails part way, the rest of the tensors are still read, so that the gathers the other
        ranks make (FSDP) all meet theirs before the failure is broadcast."""
        try:
            return self.workers.update_weights(update)
        finally:
            self._drain(tensors)

    @staticmethod
    def _drain(tensors: Iterable) -> None:
        for _ in tensors:
            pass

    def wake_up(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()

    # ------------------------------------------------------------ rank 0's client, for what reads it

    @property
    def procs(self) -> list:
        return self.workers.procs if self.workers is not None else []

    @property
    def exit_codes(self) -> list:
        return self.workers.exit_codes if self.workers is not None else []
