"""The packed path's LM head applied by hand, as before issue 37 (tests/training/test_packing.py and
bench/packing_families.py compare the model's forward with it)."""

from __future__ import annotations


def head_by_hand(model, mb):
    """The packed path before issue 37: the decoder's hidden states at head_index times the LM head's weights, skipping
    what the family's forward does after its head. Kept to show the test models are ones where that matters, and to
    force the packed path wrong for the start-up check."""
    captured = []
    handle = model.get_decoder().register_forward_hook(lambda _m, _a, output: captured.append(output[0]))
    try:
        model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    hidden = captured[0].reshape(-1, captured[0].shape[-1])
    return model.get_output_embeddings()(hidden[mb.head_index])[None]
