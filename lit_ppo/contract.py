"""The engine contract: what every rollout engine does for the trainer and the data module, and the one typed weight
update the trainer hands to all of them.

Engines: the in-process vLLM engine (`rollout/engine.py`), the HF engine that generates with the actor itself
(`rollout/hf_engine.py`), the rollout workers' clients (`rollout/workers/`: `RolloutWorkers`, `DataParallelWorkers`,
`ServerWorkers`) and `testing.NullEngine`. Each is one implementation of `RolloutEngine`: the trainer never asks which
one it holds. Beside it, two more contracts: `AheadOfTimePool`, the workers' clients' requests queued now and collected
later (rollout/schedule.py), and `WorkerWeightTransfer`, an engine's end of the weight push in a rollout worker
(rollout/workers/worker_main.py; the push itself: rollout/weight_transfer/). tests/test_contract.py checks every
implementation's signatures against its Protocol. Which engine a run starts is the registry's
(rollout/registry.py). A new engine or transport is a new class, not a new branch."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Protocol, Sequence, runtime_checkable

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


@dataclass(frozen=True)
class GenerateRequest:
    """What every engine's `generate` takes: `n` responses to each prompt (token ids), sampled at `temperature` and
    `top_p`, each ending at its token limit, at any of `stop_token_ids` (kept as its last token, like EOS) or at a
    `stop` string (cut from its text). The rollout's request is built in one place (the data module's
    `sampling_request`); an episode's turns build theirs (rollout/episodes.py)."""

    prompt_token_ids: list[list[int]]
    n: int
    temperature: float
    top_p: float
    max_tokens: int | list[int]  # one limit for all, or one per prompt (episodes: what is left of each one's budget)
    seeds: list[int] | None = None  # one per prompt (`rollout.engine.sampling_seeds`); None: unseeded (greedy)
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()

    def __post_init__(self):
        if self.seeds is not None and len(self.seeds) != len(self.prompt_token_ids):
            raise ValueError(
                f"generate: {len(self.seeds)} seeds for {len(self.prompt_token_ids)} prompts; give one seed per prompt"
            )

    @property
    def prompt_count(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def limits(self) -> list[int]:
        """Each prompt's token limit."""
        if isinstance(self.max_tokens, list):
            return self.max_tokens
        return [self.max_tokens] * len(self.prompt_token_ids)

    def share(self, start: int, stop: int) -> "GenerateRequest":
        """The request of prompts start..stop - 1 (a rollout worker's contiguous share)."""
        return replace(
            self,
            prompt_token_ids=self.prompt_token_ids[start:stop],
            max_tokens=self.max_tokens[start:stop] if isinstance(self.max_tokens, list) else self.max_tokens,
            seeds=None if self.seeds is None else self.seeds[start:stop],
        )


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

    def generate(self, request: GenerateRequest) -> list[Generation]:
        """The request's samples, grouped by prompt (all n of prompt 0 first, then prompt 1, ...), with the log-probs of
        the distribution sampled from (after temperature and top-p). Seeded, a sample's randomness does not depend on
        the other prompts of the request."""
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


@runtime_checkable
class AheadOfTimePool(Protocol):
    """An engine whose requests are queued now and collected later, generated by policy versions pushed before them:
    the rollout workers' clients, which `rollout.schedule.AheadOfTimeSource` drives up to k steps ahead."""

    @property
    def version(self) -> int | None:
        """The policy version pushed last (None before the first push): what a request submitted now samples from."""
        ...

    def submit(self, request: GenerateRequest):
        """Queue the request (a `GenerateRequest`, or where the pool runs them `rollout.episodes.EpisodeRequest`)
        behind what is queued; returns the ticket that `collect` takes."""
        ...

    def collect(self, ticket) -> tuple[list[Generation], list[int], float]:
        """The ticket's generations in prompt order, each one's policy version, and the seconds they took."""
        ...


@runtime_checkable
class WorkerWeightTransfer(Protocol):
    """A rollout worker's engine's end of the weight push (rollout/weight_transfer/): it joins the trainer's group,
    receives each push while it generates, and loads one when the worker's ordered commands reach it."""

    @property
    def weight_version(self) -> int:
        """The policy version applied last; 0: as loaded."""
        ...

    @property
    def weight_transfer_name(self) -> str:
        """What receives the pushes, for the worker's log."""
        ...

    def open_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's weight-transfer group (`backend.GlooInitInfo`'s fields) and receive every push."""
        ...

    def apply_weight_transfer(self, update_infos: list[dict], version: int) -> None:
        """Load a received push (its buckets' update infos) as policy `version`."""
        ...

    def apply_adapter_transfer(self, update_infos: list[dict], peft_config: dict, version: int) -> None:
        """Load a received adapter (model.lora) as adapter `version`."""
        ...

    def set_weight_version(self, version: int) -> None: ...

    def close_weight_transfer(self) -> None: ...

    def sequence_logprobs(self, prompt_token_ids: list[int], response_token_ids: list[int]) -> list[float]:
        """The engine's log-probability of each response token given the prompt: the probe check after a push."""
        ...
