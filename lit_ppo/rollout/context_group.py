"""A context-parallel group's rollouts (issue 51, strategy.context_parallel_size = C > 1): the C ranks of a group train
one data-parallel rank's samples, so rank 0 of the group alone generates and scores them, and broadcasts the rollout
batch to the group's other ranks (`lit_ppo/context_share.py:shared_by_group`, which also says how a failure stops the
group), which train the identical batch and generate nothing. A reward that is not deterministic (code execution, a
judge, anything timed) or a sampler whose last bits differ between devices then cannot split a group, and generation
and rewards run once, not C times. The held-out evaluation is shared the same way.

The other ranks' engine (`FollowerEngine`) generates nothing. It still takes every weight sync's tensors, unread, in
order: under FSDP each is gathered from every rank (a collective). Where the engine's start is itself a collective
(`EngineRow.starts_on_every_rank`: colocated vLLM's external_launcher creates its process groups over every rank) the
real engine is started too and put to sleep at once (its memory freed where vLLM's sleep mode is on); otherwise
(rollout.engine=hf) nothing starts.
"""

from __future__ import annotations

from lit_ppo.contract import GenerateRequest, Generation, RolloutEngine, WeightUpdate
from lit_ppo.engine_registry import engine_row


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
