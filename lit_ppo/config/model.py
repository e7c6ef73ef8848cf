"""The `model` section: the policy's weights, its attention kernels, the tiny model's shape and warm start, and the
LoRA adapter (`validate_lora`: what vLLM cannot serve, refused before any model loads)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_ppo.config.distill import TeacherConfig
from lit_ppo.config_fields import above, at_least, within
from lit_ppo.errors import ConfigError
from lit_ppo.model_shape import ModelShape


@dataclass(frozen=True)
class TinyModelConfig:
    """`model.tiny`: the shape of the locally built Qwen2-architecture model (lit_ppo/demo/tiny.py)."""

    hidden_size: int = field(default=128, metadata=at_least(1))
    num_layers: int = field(default=4, metadata=at_least(1))
    num_heads: int = field(default=4, metadata=at_least(1))
    num_kv_heads: int = field(default=2, metadata=at_least(1))
    intermediate_size: int = field(default=384, metadata=at_least(1))
    max_position_embeddings: int = field(default=128, metadata=at_least(2))


@dataclass(frozen=True)
class WarmStartConfig:
    """`model.warm_start`: supervised training of the tiny model on demonstrations before RL (lit_ppo/demo/warmstart.py)."""

    enabled: bool = True
    steps: int = field(default=1500, metadata=at_least(0))
    """Optimizer steps of supervised training."""
    batch_size: int = field(default=64, metadata=at_least(1))
    """Demonstrations per step."""
    lr: float = field(default=1.0e-3, metadata=above(0))
    teacher_accuracy: float = field(default=0.35, metadata=within(0, 1))
    """Share of demonstrations with the right answer; the rest are one too high."""
    tool_call_rate: float | None = field(default=None, metadata=within(0, 1))
    """With an environment: the teacher calls the tool this often and guesses otherwise; null: no tool calls."""
    tool_use_practice: float = field(default=0.0, metadata=at_least(0))
    """With tool_call_rate: further demonstrations of using a call once made."""
    long_fraction: float = field(default=0.0, metadata=within(0, 1))
    """Share of demonstrations that think before they answer: `long_pad_tokens` spaces, then the answer (the integer
    reward strips them), so the policy's response lengths get a heavy tail (+experiment=long_tail); 0: none."""
    long_pad_tokens: int = field(default=24, metadata=at_least(1))
    """With long_fraction: the spaces a long demonstration writes before its answer."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values (vllm/config/lora.py)
LORA_INITS = ("default", "gaussian")  # peft init_lora_weights that leave the base weights untouched


@dataclass(frozen=True)
class LoraConfig:
    """`model.lora`: a PEFT LoRA on the actor (and the critic's body, whose value head stays fully trainable); the base
    weights frozen, the reference model is the actor with its adapter disabled, and only the adapter is synced into
    vLLM (docs/lora.md). Settings vLLM cannot serve are refused here, before any model loads."""

    rank: int = 0
    """The LoRA rank r; 0: no LoRA (full-parameter training)."""
    alpha: float = 16.0
    """The LoRA scaling numerator: the update is (alpha / rank) B A."""
    target_modules: str | list[str] = "all-linear"
    """Linear module names to adapt (e.g. [q_proj, v_proj]; each matches the modules whose name ends with it, as peft
    matches them), or all-linear: every linear layer but the LM head. The pre-flight matches them against the model's
    modules, built from its config.json on the meta device (`preflight.lora_targets`), before any model loads."""
    dropout: float = 0.0
    """Must be 0: the PPO ratio and the comparison with vLLM's log-probs assume a deterministic policy."""
    init: str = "default"
    """peft's init_lora_weights: default (A Kaiming-uniform, B zero) or gaussian; both leave the base untouched."""
    use_dora: bool = False
    """Refused when true: vLLM does not serve DoRA adapters."""
    bias: str = "none"
    """Refused unless none: vLLM does not serve adapter biases."""
    modules_to_save: list[str] = field(default_factory=list)
    """Refused when set: vLLM serves modules_to_save only for classification heads, not on a causal LM."""
    save_merged: bool = False
    """Also save the final policy merged into the base weights as a Hugging Face model (actor_merged/)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def vllm_max_lora_rank(self) -> int:
        """The smallest max_lora_rank vLLM allows that holds this rank."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)

    def __post_init__(self) -> None:
        validate_lora(self)


def validate_lora(lora: LoraConfig) -> None:
    """Refuse, naming the key, what the adapter-only sync into vLLM cannot serve."""
    if not isinstance(lora.rank, int) or isinstance(lora.rank, bool) or lora.rank < 0:
        raise ConfigError(f"model.lora.rank={lora.rank!r} must be 0 (no LoRA) or a positive integer; fix: e.g. 16")
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(
            f"model.lora.rank={lora.rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}); "
            f"fix: model.lora.rank={VLLM_LORA_RANKS[-1]} or less"
        )
    if not lora.enabled:
        return
    if lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha={lora.alpha} must be positive; fix: e.g. model.lora.alpha=2*rank")
    if lora.dropout != 0:
        raise ConfigError(
            f"model.lora.dropout={lora.dropout}: dropout makes the policy random in training but not in vLLM, so the "
            "PPO ratio and the stale-weight check compare different functions; fix: model.lora.dropout=0"
        )
    if lora.use_dora:
        raise ConfigError("model.lora.use_dora=true: vLLM cannot serve DoRA adapters; fix: model.lora.use_dora=false")
    if lora.bias != "none":
        raise ConfigError(f"model.lora.bias={lora.bias}: vLLM cannot serve adapter biases; fix: model.lora.bias=none")
    if lora.modules_to_save:
        raise ConfigError(
            f"model.lora.modules_to_save={list(lora.modules_to_save)}: vLLM serves fully trained modules only for "
            "classification heads, not on the policy; fix: model.lora.modules_to_save=[] (or full fine-tuning, rank=0)"
        )
    if lora.init not in LORA_INITS:
        raise ConfigError(
            f"model.lora.init={lora.init!r}: inits such as pissa, olora or loftq change the base weights, which vLLM "
            f"keeps as loaded; fix: use one of {', '.join(LORA_INITS)}"
        )
    if not lora.target_modules:
        raise ConfigError("model.lora.target_modules is empty; fix: e.g. model.lora.target_modules=all-linear")
    if isinstance(lora.target_modules, str) and lora.target_modules != "all-linear":
        raise ConfigError(
            f"model.lora.target_modules={lora.target_modules!r} is a string, which peft reads as a regular expression "
            "over whole module names (model.layers.0.self_attn.q_proj), not as a module name; fix: a list, "
            f"model.lora.target_modules=[{lora.target_modules}], or all-linear"
        )


@dataclass(frozen=True)
class ModelConfig:
    """The `model` group: the policy (and the critic's and reference's initial weights)."""

    path: str | None = None
    """A local directory (or hub name) of a causal LM; null builds the tiny model."""
    gradient_checkpointing: bool = False
    architecture: ModelShape | None = None
    """The shape for the memory estimate of `mode=plan` where config.json is not on this machine."""
    tiny: TinyModelConfig | None = field(default_factory=TinyModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    teacher: TeacherConfig | None = None
    """On-policy distillation's teacher (ppo=distill sets it); null: none."""
    attn_implementation: str | None = None
    """The attention kernels of the trained models (transformers' `attn_implementation`): null leaves transformers'
    default (sdpa); flash_attention_2 / flash_attention_3 (the flash-attn package) train packed micro-batches in one
    row with per-sample varlen kernels, flex_attention in one row padded to a fixed token budget (the plan's
    row_tokens: compiled once) under a block-sparse mask, where sdpa/eager compute each packed row's attention under a
    block-diagonal mask (lit_ppo/training/packing.py). Checked by the pre-flight before any model loads (flex_attention:
    a GPU, where torch has no flex attention backward on a CPU)."""

    def __post_init__(self) -> None:
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"model.attn_implementation={self.attn_implementation!r} is unknown; fix: null (transformers' default) "
                f"or one of {', '.join(ATTN_IMPLEMENTATIONS)}"
            )


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
