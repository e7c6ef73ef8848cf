"""The `rollout.hf` section: the settings of the Hugging Face generate engine alone (rollout.engine=hf;
lit_ppo/rollout/hf_engine.py reads them, and the memory estimate), and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from lit_ppo.config.parse import positive


@dataclass(frozen=True)
class HFConfig:
    """`rollout.hf`: the HF engine's own settings (a run with another rollout.engine names any it set in a plan note)."""

    max_batch_sequences: int | None = None
    """Sequences per generate call at most (a batch's KV cache and logits); null: a call's all."""

    def __post_init__(self) -> None:
        if self.max_batch_sequences is not None:
            positive("rollout.hf", max_batch_sequences=self.max_batch_sequences)

    def memory_inputs(self) -> dict:
        """What the memory estimate reads of this section (`lit_ppo.memory.MemoryInputs`' keywords)."""
        return dict(hf_batch_sequences=self.max_batch_sequences)
