"""The names of vLLM's weight-transfer interface (`vllm.distributed.weight_transfer.base` and `.factory`) that the
`lit_ppo_gloo` push uses, for a machine without vLLM: `rollout.engine=hf` rollout workers need no vLLM (a GPU image
without it, Apple, some AMD set-ups), but the push is written against vLLM's interface. backend.py imports
vLLM's own classes where vLLM is installed and these otherwise, so the trainer's end of the push and an HF worker's run
the same code either way. Same names, fields and calls as vLLM's, as far as the push uses them (compared with vLLM's
by tests/rollout/test_weight_transfer.py where vLLM is installed); vLLM's worker-side engine (`WeightTransferEngine`)
runs inside a vLLM engine only, so here it cannot be built."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Generic, Iterator, TypeVar

import torch

InitInfo = TypeVar("InitInfo")
UpdateInfo = TypeVar("UpdateInfo")


@dataclass(frozen=True)
class ParamMeta:
    """One pushed tensor's name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class WeightSource(ABC):
    """One version's tensors: declared by `metadata()` before any is read, then iterated."""

    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        raise NotImplementedError

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError


@dataclass
class WeightTransferInitInfo(ABC):  # noqa: B024 - a marker base, as vLLM's
    """A worker's side of the rendezvous."""


@dataclass
class WeightTransferUpdateInfo(ABC):  # noqa: B024 - a marker base, as vLLM's
    """One update's (bucket's) description."""


@dataclass
class TrainerInitInfo:
    """The trainer's side of the rendezvous; rank 0 sends."""

    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs) -> None:  # as vLLM's: the backend is the factory's key
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "backend", None):
            raise TypeError(f"{cls.__name__} must set a class-level `backend` string (the factory's registry key)")

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class TrainerWeightTransferEngine(ABC, Generic[InitInfo]):
    """The trainer's end: built by `WeightTransferTrainerFactory.trainer_init` from its init info's backend."""

    def __init__(self, *, client, source: WeightSource | None = None, is_sender: bool = True) -> None:
        self.is_sender, self.client, self.source = is_sender, client, source

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info: InitInfo, *, client, source: WeightSource | None = None):
        """The rendezvous; a ready engine on every trainer rank."""
        raise NotImplementedError

    @abstractmethod
    def send_weights(self, *args, **kwargs) -> None:
        """One push: start, one update per bucket, finish."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class WeightTransferEngine(ABC, Generic[InitInfo, UpdateInfo]):
    """vLLM's worker-side engine, which only a vLLM engine builds."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("a vLLM weight-transfer engine needs vLLM, which is not installed; fix: pip install vllm")


class _Registry:
    _registry: dict[str, Callable[[], type]]

    @classmethod
    def register_engine(cls, name: str, engine: type) -> None:
        if name in cls._registry:
            raise ValueError(f"weight transfer engine {name!r} is already registered")
        cls._registry[name] = lambda: engine


class WeightTransferEngineFactory(_Registry):
    _registry: dict[str, Callable[[], type]] = {}


class WeightTransferTrainerFactory(_Registry):
    _registry: dict[str, Callable[[], type]] = {}

    @classmethod
    def trainer_init(cls, init_info: TrainerInitInfo, *, client, source: WeightSource | None = None):
        if init_info.backend not in cls._registry:
            raise ValueError(f"weight transfer backend {init_info.backend!r} is not registered ({list(cls._registry)})")
        return cls._registry[init_info.backend]().trainer_init(init_info, client=client, source=source)
