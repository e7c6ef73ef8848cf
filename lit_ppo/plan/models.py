"""The models and the engine: which models train (critic, reference), the precision, and the engine that generates."""

from __future__ import annotations

from dataclasses import dataclass

from lit_ppo.config import RunConfig
from lit_ppo.plan.lora import LoraPlan
from lit_ppo.plan.table import Row
from lit_ppo.precision import describe as describe_precision
from lit_ppo.precision import resolve_precision, resolve_rollout_dtype


@dataclass(frozen=True)
class ModelsPlan:
    """Which models train and how: critic, reference, precision, and the engine that generates."""

    critic_enabled: bool
    reference_enabled: bool
    precision: str = "32-true"  # resolved (lit_ppo.precision): 32-true, bf16-mixed or bf16-true
    rollout_dtype: str = "float32"  # vLLM's dtype (rollout.engine=hf: the trainer's compute dtype)
    rollout_engine: str = "vllm"  # rollout.engine: vllm, or hf (the actor generates; shares its weights, no sync)

    def rows(self, workers: bool, lora: LoraPlan | None) -> list[Row]:
        """`workers`: whether rollout workers generate (WorkersPlan); `lora`: the adapter trained, None without."""
        where = "in each rollout worker" if workers else "in this process"
        synced = "pushed over gloo" if workers else "synced"
        if self.rollout_engine == "hf" and workers:
            what = "only the adapter" if lora is not None else "the actor's weights"
            engine = (
                "engine",
                "hf",
                f"Hugging Face generate {where}: a copy of the actor loaded from model_dir, {what} {synced} after "
                "each rollout step",
            )
        elif self.rollout_engine == "hf":
            engine = ("engine", "hf", "the actor generates (Hugging Face generate): shares its weights, no sync")
        elif lora is not None:
            engine = (
                "engine",
                "vllm",
                f"vLLM {where}: the base loaded once, only the adapter {synced} after each rollout step "
                f"(a new adapter version; max_lora_rank {lora.vllm_max_lora_rank})",
            )
        else:
            engine = ("engine", "vllm", f"vLLM {where}: the actor's weights {synced} after each rollout step")
        return [
            (
                "reference model",
                "yes" if self.reference_enabled else "no",
                "the actor with its adapter disabled (no copy of the weights)"
                if self.reference_enabled and lora is not None
                else "",
            ),
            ("precision", self.precision, describe_precision(self.precision)),
            engine,
            ("vLLM dtype" if self.rollout_engine == "vllm" else "rollout dtype", self.rollout_dtype, "sampling"),
        ]


def models_plan(config: RunConfig) -> ModelsPlan:
    """The models the run trains and holds, the precision and vLLM's dtype resolved (`lit_ppo.precision`)."""
    precision = resolve_precision(config.strategy.precision, config.strategy.accelerator)
    return ModelsPlan(
        critic_enabled=config.ppo.advantage_estimator == "gae",
        reference_enabled=config.ppo.kl_coef > 0,
        precision=precision,
        rollout_dtype=resolve_rollout_dtype(precision, config.rollout.dtype),
        rollout_engine=config.rollout.engine,
    )
