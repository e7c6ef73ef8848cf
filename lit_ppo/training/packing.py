"""Which models can train on packed micro-batches (ppo.packing): whole samples laid end to end in a row, position ids
restarting at each sample, no attention mask.

transformers (5.x) reads such position ids itself: models whose modeling code builds their masks with
`masking_utils.create_causal_mask` find the sample boundaries (`find_packed_sequence_indices`) and make a
block-diagonal causal mask for sdpa, eager and flex attention; flash-attention turns them into its varlen kernel's
cumulative lengths. Nothing here computes attention. That keeps attention within a sample, and nothing else: layers
with a recurrent state (Mamba, gated delta nets, MiniMax's lightning attention; transformers marks their models
`_is_stateful` or names them in `layer_types`) carry it from one sample of a row into the next (tiny random Falcon-H1,
Qwen3-Next, MiniMax and OLMo-hybrid models: a token changed in one sample moved the next one's log-probs by 2e-5,
4e-4, 0.02 and 0.09 nats), so those model types are refused. What a model does after its decoder (Gemma2's
softcapping, Cohere's and Granite's logit scales) is its own forward's in the packed path too
(`training/models.py: packed_response_logits`), and the run's first micro-batch proves packed = padded for the model
at hand (`training/packing_check.py`). Imported by the pre-flight (config.json's model_type, before any model loads)
and by the model loader (the attention implementation the model got)."""

from __future__ import annotations

import importlib

# Attention implementations that keep packed samples apart from the position ids alone.
MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")  # a block-diagonal mask over the whole row
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")  # per-sample kernels: one row per micro-batch
# transformers' layer types with a recurrent state (Mamba, gated delta net, MiniMax's lightning attention; hybrids of
# attention and such a state): configuration_utils.ALLOWED_ATTN_LAYER_TYPES
RECURRENT_LAYER_TYPES = ("linear_attention", "hybrid", "hybrid_sliding")


def packing_unsupported(model_type: str, attn_implementation: str | None = None) -> str | None:
    """Why a model of `model_type` (config.json) with `attn_implementation` cannot take packed position ids; None
    when it can. Without an attention implementation (the pre-flight, nothing loaded) only the model type is read."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)  # gemma3_text: gemma3's modeling code
    try:
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except ImportError:
        return f"transformers has no modeling code for model_type={model_type!r} to read packed position ids"
    if not hasattr(modeling, "create_causal_mask"):
        return (
            f"transformers' {model_type} models do not build their attention mask from packed position ids "
            "(masking_utils.create_causal_mask)"
        )
    if has_recurrent_layers(modeling, model_type):
        return (
            f"transformers' {model_type} models have recurrent layers (state-space, linear attention), whose state "
            "runs on from one packed sample into the next"
        )
    if attn_implementation is not None and attn_implementation not in MASKED_ATTENTION + VARLEN_ATTENTION:
        return f"attention implementation {attn_implementation!r} is not one that reads packed position ids"
    return None


def has_recurrent_layers(modeling, model_type: str) -> bool:
    """Whether transformers says a model type's layers carry a state along the sequence: its models are stateful
    (`_is_stateful`, which also keeps them from assisted generation) or its config's default layer types include
    recurrent ones. To such layers a packed row is one sequence."""
    from transformers import CONFIG_MAPPING

    if any(
        getattr(value, "_is_stateful", False) is True
        for value in vars(modeling).values()
        if isinstance(value, type) and value.__module__ == modeling.__name__
    ):
        return True
    try:
        layer_types = getattr(CONFIG_MAPPING[model_type](), "layer_types", None) or []
    except Exception:  # a config without defaults for every field: the flag above decides
        layer_types = []
    return bool(set(layer_types) & set(RECURRENT_LAYER_TYPES))


def one_row(attn_implementation: str) -> bool:
    """Whether a packed micro-batch goes in one row: for varlen kernels (cost per sample, and transformers reads packed
    position ids for them in a batch of one row only) and for flex attention (`fixed_row`)."""
    return attn_implementation in VARLEN_ATTENTION or fixed_row(attn_implementation)


def fixed_row(attn_implementation: str | None) -> bool:
    """Whether a packed micro-batch goes in one row padded to a fixed token budget (`plan.layout.row_tokens`): flex
    attention, which transformers compiles (torch.compile) with the row's shape; a row of another length compiles
    again, and then with dynamic shapes. Its block mask skips the blocks no sample attends to, so one long row costs
    per sample, as the varlen kernels' (at blocks of 128 positions)."""
    return attn_implementation == "flex_attention"


MASK_ATTENTION = ("sdpa", "eager")  # implementations that take a ready 4-D mask as it is
BLOCK_MASK_ATTENTION = ("flex_attention",)  # takes a ready block mask (torch's BlockMask) as it is


def shared_prefix_unsupported(config, attn_implementation: str | None) -> str | None:
    """Why a model (its transformers config) with `attn_implementation` cannot take the shared-prefix layout exactly;
    None when it can."""
    if attn_implementation not in MASK_ATTENTION + BLOCK_MASK_ATTENTION:
        return (
            f"attention implementation {attn_implementation!r} takes no ready 4-D mask (the layout needs sdpa, eager "
            "or flex_attention; flash-attention's varlen kernels cannot keep sibling responses apart here)"
        )
    layer_types = getattr(config, "layer_types", None) or []
    # A config.json read as it is (the pre-flight) may lack the layer types transformers derives (Gemma2's); a window
    # without a switch that turns it off (Qwen2's use_sliding_window) is taken as used.
    switch = getattr(config, "use_sliding_window", None)
    windowed = switch if switch is not None else bool(getattr(config, "sliding_window", None))
    if windowed or "sliding_attention" in layer_types:
        return f"the {config.model_type} model has sliding-window layers, whose window a ready 4-D mask drops"
    return None
