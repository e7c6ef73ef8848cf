"""LoRA (model.lora): a PEFT adapter on a frozen base, with the modules it adapts as the pre-flight matched them."""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_ppo.config import RunConfig
from lit_ppo.plan.table import Row


@dataclass(frozen=True)
class LoraTargets:
    """The linear modules that `model.lora.target_modules` adapts in the model and the adapter's size, matched by the
    pre-flight on the model's architecture built from its config.json on the meta device (`preflight.lora_targets`);
    None where config.json is not on this machine (`mode=plan`)."""

    modules: tuple[str, ...]
    """Whole module names, in the model's order: model.layers.0.self_attn.q_proj, ..."""
    adapter_parameters: int
    """One model's (the actor's) adapter: rank x (in + out features) summed over `modules`."""

    @property
    def names(self) -> list[str]:
        """The adapted modules' own names (the last part), each once, in the model's order: q_proj, v_proj."""
        return list(dict.fromkeys(module.rsplit(".", 1)[-1] for module in self.modules))


@dataclass(frozen=True)
class LoraPlan:
    """A PEFT adapter on a frozen base: the reference is the actor with its adapter disabled (no copy), and only the
    adapter goes to vLLM (vllm_max_lora_rank: vLLM's slot size for it)."""

    rank: int
    alpha: float
    target_modules: str | list[str]
    vllm_max_lora_rank: int
    # Matched on the model by the pre-flight (LoraTargets): the adapted linear modules' own names, how many modules
    # that is in the whole model, and the actor's adapter parameters; [] / 0 / None where config.json was not read.
    adapted_names: list[str] = field(default_factory=list)
    adapted_modules: int = 0
    adapter_parameters: int | None = None

    def rows(self, critic: bool, precision: str) -> list[Row]:
        """`critic`: whether a value head trains (ModelsPlan.critic_enabled); `precision`: ModelsPlan.precision."""
        trained = ", adapter and value head" if critic else ", adapter"
        rows = [
            (
                "LoRA",
                f"rank {self.rank}",
                f"alpha {self.alpha:g}, targets {self.target_modules}; base weights frozen"
                + (" in bf16" if precision == "bf16-mixed" else "")
                + trained
                + " trained in float32",
            )
        ]
        if self.adapter_parameters is not None:
            rows += [
                (
                    "LoRA adapted modules",
                    self.adapted_modules,
                    f"linear modules {', '.join(self.adapted_names)}, matched on the model's architecture",
                ),
                (
                    "LoRA adapter parameters",
                    f"{self.adapter_parameters / 1e6:.3f} M",
                    f"per model: rank x (in + out features) of each adapted module ({self.adapter_parameters:,})",
                ),
            ]
        return rows


def lora_plan(config: RunConfig, targets: LoraTargets | None) -> LoraPlan | None:
    """The LoRA section (None without model.lora), with the pre-flight's matched modules where it read them."""
    lora = config.model.lora
    if not lora.enabled:
        return None
    return LoraPlan(
        rank=lora.rank,
        alpha=lora.alpha,
        target_modules=lora.target_modules,
        vllm_max_lora_rank=lora.vllm_max_lora_rank,
        adapted_names=targets.names if targets else [],
        adapted_modules=len(targets.modules) if targets else 0,
        adapter_parameters=targets.adapter_parameters if targets else None,
    )
