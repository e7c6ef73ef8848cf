"""Stand-ins that tests and benchmarks share when a run should train without generating (in the manner of
`lightning.pytorch.demos`): an engine that does nothing, and a data module that serves one fixed rollout batch."""

from __future__ import annotations

import dataclasses

from lit_ppo.batch import RolloutBatch
from lit_ppo.datamodule import RolloutDataModule


class NullEngine:
    """Stands in for vLLM where a run trains on a fixed batch: no generation, no weight sync."""

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def sync_weights(self, named_tensors) -> None:
        pass

    def close(self) -> None:
        pass


class FixedBatchDataModule(RolloutDataModule):
    """Serves `fixed_batch` (set it before `trainer.fit`) at every rollout step instead of generating one."""

    fixed_batch: RolloutBatch

    def produce_rollout(self, rollout_step: int) -> RolloutBatch:
        self.next_rollout_step = rollout_step + 1
        return dataclasses.replace(self.fixed_batch, rollout_step=rollout_step)
