"""The shared-prefix layout of packed micro-batches (ppo.shared_prefix): the samples of one prompt group (the same
prompt ids: a prompt's n responses, a multi-turn episode's first prompt) in one micro-batch lay their prompt out once,
followed by each response; a response attends to the prompt and to itself only, never to a sibling, and its position
ids go on from the prompt's length. Every response token then sees exactly the context of its own sample, at the same
positions, so log-probs, values, entropies and gradients are the flat packed layout's (float32 sums in another order:
tests/training/test_shared_prefix.py); the prompt's tokens are computed once instead of n times.

transformers takes such a mask as a ready 4-D mask (`masking_utils._preprocess_mask_arguments` returns a 4-D tensor
or a BlockMask as it is): boolean for sdpa (True: attend), additive for eager, a BlockMask of the same rule for flex
attention (the blocks no position attends to skipped; the row padded to the plan's fixed budget, no dense mask built).
Flash-attention's varlen kernels take no mask, and a sliding window would be dropped by a ready mask, so those are
refused (`training/packing.py:shared_prefix_unsupported`).

Shapes: B samples of a micro-batch, T its longest response; R rows of L positions.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lit_ppo.training.batching import (
    MicroBatch,
    balanced_partition,
    first_fit,
    fixed_row_length,
    policy_mask_rows,
)


def prompt_groups(prompt_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """The positions of `prompt_ids` grouped by identical prompts, in the order of each group's first sample."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, prompt in enumerate(prompt_ids):
        groups.setdefault(tuple(prompt), []).append(b)
    return list(groups.values())


def prefix_tokens_saved(prompt_ids: Sequence[Sequence[int]]) -> int:
    """Prompt tokens the shared-prefix layout does not compute for these samples (one micro-batch): each group's prompt
    once instead of once per sample."""
    return sum((len(g) - 1) * len(prompt_ids[g[0]]) for g in prompt_groups(prompt_ids))


def shared_prefix_micro_batch_groups(
    prompt_ids: Sequence[Sequence[int]],
    response_lengths: list[int],
    indices: list[int],
    *,
    max_samples: int,
    max_tokens: int | None = None,
    min_count: int = 0,
) -> list[list[int]]:
    """Micro-batches of the samples `indices` that keep prompt groups together, so that their prompt is laid out once.
    Fixed size (max_tokens None): the groups, heaviest first, cut into consecutive runs of `max_samples` samples (as
    many micro-batches of as many samples as the flat layout). Token budget: the groups (split where one is over the
    budget) balanced by the tokens the layout computes (`balanced_partition`): the fewest micro-batches (at least
    `min_count`) each within `max_tokens`; a sample longer than the budget alone. The loss denominators are the
    mini-batch's: the split does not change the update."""

    def tokens(members: list[int]) -> int:  # what the layout computes for these samples: each prompt once
        return sum(len(prompt_ids[g[0]]) for g in prompt_groups([prompt_ids[i] for i in members])) + sum(
            response_lengths[i] for i in members
        )

    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        by_prompt.setdefault(tuple(prompt_ids[i]), []).append(i)
    units = sorted(by_prompt.values(), key=tokens, reverse=True)
    if max_tokens is None:
        order = [i for unit in units for i in unit]
        return [order[start : start + max_samples] for start in range(0, len(order), max_samples)]
    chunks: list[list[int]] = []
    for unit in units:  # a group over the budget in pieces within it
        piece: list[int] = []
        for i in unit:
            if piece and tokens(piece + [i]) > max_tokens:
                chunks.append(piece)
                piece = []
            piece.append(i)
        chunks.append(piece)
    if min_count > len(indices):
        raise ValueError(f"cannot make {min_count} micro-batches of {len(indices)} samples")
    while len(chunks) < min_count:  # ranks must run as many micro-batches: split the largest piece
        largest = max(range(len(chunks)), key=lambda c: len(chunks[c]))
        piece = chunks.pop(largest)
        chunks[largest:largest] = [piece[: len(piece) // 2], piece[len(piece) // 2 :]]
    weights = [tokens(chunk) for chunk in chunks]
    count = max(min_count, -(-sum(weights) // max_tokens))
    while True:
        parts = balanced_partition(weights, list(range(len(chunks))), count)
        groups = [[i for c in part for i in chunks[c]] for part in parts if part]
        if count >= len(chunks) or all(len(g) == 1 or tokens(g) <= max_tokens for g in groups):
            return groups
        count += 1


def pack_shared_prefix(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_id: int,
    device,
    policy_masks: list[list[int]] | None = None,
    row_tokens: int | None = None,
    dense_mask: bool = True,
) -> MicroBatch:
    """The samples in the shared-prefix layout: per prompt group its prompt, then each of its responses; the groups
    laid end to end in rows of at most the longest group or twice the longest sample, as the flat layout's rows
    (first-fit decreasing, as few rows as that finds, spread by tokens where that narrows the widest: every row's
    attention is a square of the row's length under the mask). A
    row's unused end is a segment of its own that attends to itself. The outputs keep `pack`'s per-sample [B, T]
    layout; `layout_tokens` counts the real tokens laid out (each prompt once). `row_tokens` (flex attention): every
    group in one row padded to that budget (`batching.fixed_row_length`), and no dense mask (`attention_mask_for`
    builds a block mask from `segments`); nor with `dense_mask` False (context parallelism: each rank builds the whole
    rows' mask over rows padded to a multiple of C itself, or none for one sample, `context_parallel.local_micro_batch`)."""
    B = len(prompt_ids)
    T = max(1, max(len(r) for r in response_ids))
    groups = prompt_groups(prompt_ids)
    lengths = [len(prompt_ids[g[0]]) + sum(len(response_ids[b]) for b in g) for g in groups]
    rows = group_rows(prompt_ids, response_ids, lengths, row_tokens)
    L = max(sum(lengths[g] for g in row) for row in rows)
    if row_tokens is not None:
        L = fixed_row_length(L, row_tokens)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), L), dtype=torch.long)
    segment = torch.zeros((len(rows), L), dtype=torch.long)  # one id per prompt, response and row end
    owner = torch.zeros((len(rows), L), dtype=torch.long)  # the segment a position may attend to besides its own
    predictor = torch.zeros((B, T), dtype=torch.long)  # flat position whose hidden state predicts response token t
    next_segment = 0
    for r, row in enumerate(rows):
        offset = 0
        for g in row:
            prompt = list(prompt_ids[groups[g][0]])
            P = len(prompt)
            prompt_segment = next_segment
            input_ids[r, offset : offset + P] = torch.tensor(prompt, dtype=torch.long)
            position_ids[r, offset : offset + P] = torch.arange(P)
            segment[r, offset : offset + P] = owner[r, offset : offset + P] = prompt_segment
            prompt_last = r * L + offset + P - 1
            offset += P
            next_segment += 1
            for b in groups[g]:
                response = list(response_ids[b])
                n = len(response)
                input_ids[r, offset : offset + n] = torch.tensor(response, dtype=torch.long)
                position_ids[r, offset : offset + n] = torch.arange(P, P + n)
                segment[r, offset : offset + n] = next_segment
                owner[r, offset : offset + n] = prompt_segment
                # token 0 is predicted by the prompt's last position, token t by the response's position t - 1
                predictor[b, 0] = prompt_last
                predictor[b, 1:n] = r * L + offset + torch.arange(n - 1)
                offset += n
                next_segment += 1
        position_ids[r, offset:] = torch.arange(L - offset)
        segment[r, offset:] = owner[r, offset:] = next_segment
        next_segment += 1
    attention = None  # flex attention: its block mask is built from the segments
    if row_tokens is None and dense_mask:
        attention = segment_mask(torch.stack([segment, owner])).to(device)
    responses, response_mask = policy_mask_rows(response_ids, policy_masks, pad_id, T)
    head_index = predictor[response_mask > 0]  # row-major over [B, T], as the flat layout's
    return MicroBatch(
        input_ids.to(device),
        attention,
        position_ids.to(device),
        responses.to(device),
        response_mask.to(device),
        0,
        head_index.to(device),
        layout_tokens=sum(lengths),
        segments=torch.stack([segment, owner]).to(device),
    )


def group_rows(
    prompt_ids: list[list[int]], response_ids: list[list[int]], lengths: list[int], row_tokens: int | None
) -> list[list[int]]:
    """The prompt groups (of `lengths` tokens each, laid out) in rows: all in one (flex attention's `row_tokens`), else
    first-fit decreasing in rows of at most the longest group or twice the longest sample, spread by tokens where that
    narrows the widest row."""
    if row_tokens is not None:
        rows = [list(range(len(lengths)))]
    else:
        longest_sample = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
        rows = first_fit(lengths, max(max(lengths), 2 * longest_sample))
        balanced = [row for row in balanced_partition(lengths, list(range(len(lengths))), len(rows)) if row]
        if max(sum(lengths[g] for g in row) for row in balanced) < max(sum(lengths[g] for g in row) for row in rows):
            rows = balanced
    return rows


def segment_mask(segments: Tensor) -> Tensor:
    """The shared-prefix rule over [R, L] rows (`segments`: [2, R, L], each position's segment and the one it may also
    attend to) as a dense [R, 1, L, L] boolean mask, True: attend (causal, within the segment or into its owner's)."""
    segment, owner = segments[0], segments[1]
    L = segment.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=segment.device).tril()
    same = segment[:, :, None] == segment[:, None, :]  # [R, L, L] query, key
    prefix = owner[:, :, None] == segment[:, None, :]
    return ((same | prefix) & causal)[:, None]


def attention_mask_for(model: torch.nn.Module, mb: MicroBatch):
    """The mask a packed forward of `model` passes: None for the flat layout (transformers builds it from the position
    ids), or a context-parallel rank's whole-row 4-D mask as it is (training/context_parallel.py); the shared-prefix
    layout's mask: a BlockMask for flex attention (`block_mask`), the 4-D mask, boolean for sdpa, additive (0 or the
    float minimum) for eager."""
    if mb.segments is None:
        return mb.attention_mask  # None in the flat packed layout
    implementation = model.config._attn_implementation
    if implementation == "flex_attention":
        return block_mask(mb.segments)
    if mb.attention_mask is None:
        raise ValueError(f"a shared-prefix micro-batch laid out for flex attention reached a {implementation} model")
    if implementation == "eager":
        blocked = torch.zeros(mb.attention_mask.shape, dtype=torch.float32, device=mb.attention_mask.device)
        return blocked.masked_fill_(~mb.attention_mask, torch.finfo(torch.float32).min)
    return mb.attention_mask


def block_mask(segments: Tensor):
    """The shared-prefix rule as flex attention's BlockMask over [R, L] rows (`segments`: [2, R, L], each position's
    segment and the one it may also attend to): causal, within the segment or into its owner's (a response into its
    prompt). Built as transformers builds its own (`masking_utils.flex_attention_mask`: compiled where torch >= 2.6),
    once per forward: the row's shape is fixed, so it compiles once."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.utils.import_utils import is_torch_greater_or_equal

    segment, owner = segments[0], segments[1]

    def shared_prefix_rule(batch, head, query, key):
        seen = (segment[batch, query] == segment[batch, key]) | (owner[batch, query] == segment[batch, key])
        return seen & (key <= query)

    R, L = segment.shape
    return create_block_mask(
        shared_prefix_rule, R, None, L, L, device=segment.device, _compile=is_torch_greater_or_equal("2.6")
    )
