"""The shape of a decoder-only transformer (Qwen2/Llama layout) read from its config.json: its parameters per part,
what the memory estimate (lit_ppo/memory.py) and the LoRA adapter's size (`lora_parameters`) are computed from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a decoder-only transformer (Qwen2/Llama layout)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool = True
    attention_bias: bool = True  # Qwen2: biases on q, k, v
    head_dim: int | None = None

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def q_dim(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    def layer_parameters(self) -> int:
        h, kv, q = self.hidden_size, self.kv_dim, self.q_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        return attention + 3 * h * self.intermediate_size + 2 * h  # + gate/up/down, two RMSNorms

    def embedding_parameters(self) -> int:
        """Input embeddings, LM head (unless tied) and the final norm: FSDP's root unit."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def parameters(self) -> int:
        return self.num_layers * self.layer_parameters() + self.embedding_parameters()

    def lora_parameters(self, rank: int, target_modules) -> int:
        """A LoRA adapter's parameters, rank x (in + out) per adapted linear layer of every decoder layer;
        `all-linear` adapts all seven (the LM head is never adapted)."""
        h, kv, q, i = self.hidden_size, self.kv_dim, self.q_dim, self.intermediate_size
        shapes = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        names = list(shapes) if target_modules == "all-linear" else [t for t in target_modules if t in shapes]
        return self.num_layers * sum(rank * sum(shapes[n]) for n in names)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Hugging Face config.json (Qwen2, Llama and alike)."""
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
            head_dim=config.get("head_dim"),
        )
