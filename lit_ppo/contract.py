"""The engine contract: what every rollout engine does for the trainer and the data module, and the one typed weight
update the trainer hands to all of them.

Engines: the in-process vLLM engine (`rollout/engine.py`), the HF engine that generates with the actor itself
(`rollout/hf_engine.py`), the rollout workers' client (`rollout/workers/client.py`) and `testing.NullEngine`. Each is
one implementation of `RolloutEngine`: the trainer never asks which one it holds (tests/test_contract.py checks
that every one conforms). A new engine or transport is a new class, not a new branch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, runtime_checkable

import torch


@dataclass
class Generation:
    """One sampled response."""

    prompt_index: int  # index into the prompts passed to generate()
    token_ids: list[int]
    truncated: bool  # stopped by the length limit, not by end-of-sequence
    text: str
    logprobs: list[float]  # per token: the engine's log-probability of the sampled token, after temperature and top-p
    adapter_version: int = 0  # the LoRA adapter version that sampled it (AdapterWeights); 0: no adapter


Probe = tuple[list[int], list[int], list[float]]
"""A sequence and the trainer's log-probs of its response: (prompt ids, response ids, log-probs at temperature 1)."""


@dataclass(frozen=True)
class AdapterWeights:
    """model.lora: the adapter alone, by peft's tensor names, with its peft config (plain values), to be served as
    adapter `adapter_version` (vLLM's LoRA id, >= 1) by every later generate call."""

    tensors: dict[str, torch.Tensor]
    peft_config: dict
    adapter_version: int


@dataclass(frozen=True)
class WeightUpdate:
    """The actor's weights as policy `policy_version` (the rollout steps it has taken): either every tensor by Hugging
    Face name (`tensors`, streamed: a sharded actor gathers each as it is read) or the adapter (`adapter`).
    `probe`, called only by engines that check what they applied (rollout workers), gives a sequence and the trainer's
    log-probs of it. `metadata`: with `tensors`, each one's (name, dtype, shape) in order, declared without reading
    them (`distributed.full_tensor_metadata`); a weight-transfer engine sizes and checks the push by it (rollout
    workers: `rollout/weight_transfer/backend.py`)."""

    policy_version: int
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None
    adapter: AdapterWeights | None = None
    probe: Callable[[], Probe | None] | None = None
    metadata: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None

    def __post_init__(self):
        if (self.tensors is None) == (self.adapter is None):
            raise ValueError("WeightUpdate: give either tensors (full weights) or adapter (model.lora), not both")


class CountedTensors:
    """(name, tensor) pairs passed on as they are read (streamed, never held), counting their bytes: what an engine's
    `update_weights` returns for full weights."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]]):
        self.tensors, self.bytes = tensors, 0

    def __iter__(self):
        for name, tensor in self.tensors:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer and the data module use of an engine."""

    @property
    def adapter_version(self) -> int:
        """The LoRA adapter version that serves generate calls now; 0: none (the base, or full weights)."""
        ...

    def generate(self, prompt_token_ids: list[list[int]], **params) -> list[Generation]:
        """Sample responses of the prompts (token ids); `params`: n, temperature, top_p, max_tokens, seeds (one per
        prompt: a sample's randomness does not depend on the batch), stop ids. Log-probs of the sampled distribution."""
        ...

    def update_weights(self, update: WeightUpdate) -> int:
        """Apply one weight update (every later generate call samples from it); returns the bytes it moved (0 where
        the engine generates with the trainer's own tensors)."""
        ...

    def sleep(self) -> None:
        """Free what generation holds between rollouts (vLLM's KV cache and weights), where the engine can."""
        ...

    def wake_up(self) -> None: ...

    def close(self) -> None:
        """Release the engine for good (another can start in this process)."""
        ...
