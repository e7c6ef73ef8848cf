"""`MicroBatchLayout`: how one pass over a batch (the experience forwards, a rollout step's updates) splits the samples
into this rank's micro-batches and lays each out for a forward (lit_ppo/training/batching.py's functions), what the
micro-batches laid out, counted, and each mini-batch's micro-batches checked against the plan."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator

import torch

from lit_ppo.batch import RolloutBatch
from lit_ppo.config import PPOConfig
from lit_ppo.plan import StepPlan, check_layout_tokens, check_micro_batches
from lit_ppo.training.batching import MicroBatch, packed_micro_batches, rank_micro_batch_groups
from lit_ppo.training.shared_prefix import pack_shared_prefix, prefix_tokens_saved, shared_prefix_micro_batch_groups


@dataclass
class MicroBatchLayout:
    """This rank's micro-batches of `batch`: ppo.micro_train_batch_size samples each or within
    ppo.micro_train_max_tokens (`batching.rank_micro_batch_groups`), packed end to end (`plan.layout.packing`; in one row
    when `one_row`, padded to `row_tokens` positions where given: flex attention) or padded
    (`batching.packed_micro_batches`). One per pass over a batch: it counts what the mini-batches of the pass laid
    out."""

    batch: RolloutBatch
    ppo: PPOConfig
    plan: StepPlan
    pad_token_id: int
    device: torch.device
    one_row: bool = False
    row_tokens: int | None = None  # flex attention: every packed row this long (`plan.layout.row_tokens`)
    micro_batches: int = 0  # of the mini-batches laid out so far
    positions: int = 0  # the positions they laid out (real tokens and padding)
    real_tokens: int = 0  # the prompt and response tokens they hold
    prefix_tokens_saved: int = 0  # of those, the prompt tokens the shared-prefix layout laid out once for a group

    @property
    def counts(self) -> tuple[int, int, int]:
        """(positions, real tokens, micro-batches) laid out so far."""
        return self.positions, self.real_tokens, self.micro_batches

    def split(self, indices: list[int]) -> list[list[int]]:
        """The samples `indices` in this rank's micro-batches. Under data parallelism with a token budget a collective
        (every rank runs as many micro-batches): call it where every rank does."""
        shared = shared_prefix_micro_batch_groups if self.plan.layout.shared_prefix else None
        return rank_micro_batch_groups(self.batch, indices, self.ppo, self.plan, self.device, shared)

    def lay_out(self, groups: list[list[int]]) -> Iterator[tuple[list[int], MicroBatch]]:
        """(indices, MicroBatch) of each group of samples, laid out as the run lays them out."""
        layout = self.plan.layout
        # C > 1: each rank builds the whole rows' mask itself (context_parallel.local_micro_batch), not this [L, L] one
        dense = self.plan.counts.context_parallel_size == 1
        return packed_micro_batches(
            self.batch,
            groups,
            self.pad_token_id,
            self.device,
            layout.packing,
            self.one_row,
            functools.partial(pack_shared_prefix, dense_mask=dense) if layout.shared_prefix else None,
            self.row_tokens,
        )

    def mini_batch(self, indices: list[int], rollout_step: int) -> Iterator[tuple[list[int], MicroBatch, bool]]:
        """This rank's micro-batches of the mini-batch `indices`: (indices, MicroBatch, whether it is the last, where
        the gradients are all-reduced) each, counted; once the last is through, checked against the plan
        (`plan.check_micro_batches`: its micro-batch size or token budget), before the optimizer step."""
        groups = self.split(indices)
        laid_out = []  # (samples, tokens: real ones when packed, positions when padded) per micro-batch
        for position, (idx, mb) in enumerate(self.lay_out(groups)):
            real = sum(len(self.batch.prompt_ids[i]) + len(self.batch.response_ids[i]) for i in idx)
            self.micro_batches += 1
            self.positions += mb.positions
            self.real_tokens += real
            laid_out.append((len(idx), real if mb.packed else mb.positions))
            if mb.layout_tokens is not None:  # shared prefix: each group's prompt once, proven here
                saved = prefix_tokens_saved([self.batch.prompt_ids[i] for i in idx])
                check_layout_tokens(self.plan, rollout_step, mb.layout_tokens, real, saved)
                self.prefix_tokens_saved += saved
            yield idx, mb, position == len(groups) - 1
        check_micro_batches(self.plan, rollout_step, laid_out)
