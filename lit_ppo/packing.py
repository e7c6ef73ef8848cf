"""Which models can train on packed micro-batches (ppo.packing): whole samples laid end to end in a row, position ids
restarting at each sample, no attention mask.

transformers (5.x) reads such position ids itself: models whose modeling code builds their masks with
`masking_utils.create_causal_mask` find the sample boundaries (`find_packed_sequence_indices`) and make a
block-diagonal causal mask for sdpa, eager and flex attention; flash-attention turns them into its varlen kernel's
cumulative lengths. Nothing here computes attention. Imported by the pre-flight (config.json's model_type, before any
model loads) and by the model loader (the attention implementation the model got)."""

from __future__ import annotations

import importlib

# Attention implementations that keep packed samples apart from the position ids alone.
MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")  # a block-diagonal mask over the whole row
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")  # per-sample kernels: one row per micro-batch


def packing_unsupported(model_type: str, attn_implementation: str | None = None) -> str | None:
    """Why a model of `model_type` (config.json) with `attn_implementation` cannot take packed position ids; None
    when it can. Without an attention implementation (the pre-flight, nothing loaded) only the model type is read."""
    try:
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return f"transformers has no modeling code for model_type={model_type!r} to read packed position ids"
    if not hasattr(modeling, "create_causal_mask"):
        return (
            f"transformers' {model_type} models do not build their attention mask from packed position ids "
            "(masking_utils.create_causal_mask)"
        )
    if attn_implementation is not None and attn_implementation not in MASKED_ATTENTION + VARLEN_ATTENTION:
        return f"attention implementation {attn_implementation!r} is not one that reads packed position ids"
    return None


def one_row(attn_implementation: str) -> bool:
    """Whether a packed micro-batch goes in one row: for varlen kernels (cost per sample, and transformers reads packed
    position ids for them in a batch of one row only)."""
    return attn_implementation in VARLEN_ATTENTION
