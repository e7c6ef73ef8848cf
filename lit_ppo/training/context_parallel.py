"""Context parallelism, Ulysses style (issue 51): the C ranks of a context-parallel group share one micro-batch and
each runs the model on 1/C of every row's positions; around attention an all-to-all swaps that sequence split for a
split of the heads (each rank then attends over whole rows with H/C heads), and back after. Every other layer works
per position, so the rest of the forward is the one-rank forward on fewer positions.

Exact by construction: the whole row's attention mask is built before the split by transformers' own
`create_causal_mask` (padding, causality, packed rows' block-diagonal rule: the mask the one-rank forward uses), or
for the shared-prefix layout by its own rule (`shared_prefix.segment_mask`: a response attends to its prompt and to
itself), and handed to the model as a 4-D mask, which transformers passes to the attention function as it is (or,
where it is causality alone, no mask: sdpa's is_causal, as in the one-rank forward); the wrapped attention function
(sdpa or eager, `ulysses`) sees the whole rows after the exchange. Under gradient checkpointing the backward
recomputes each layer after `ulysses` has exited: the checkpoint's `context_fn` (`_recompute_contexts`) captures the
forward's group, kernel and mask rule and runs the recompute inside them again, so it exchanges as the forward did.
With LoRA the adapters are more linear layers at each position, and the reference forward (the adapter disabled)
goes through the same exchange. Each rank computes the LM head
and the value head only at its own positions' response tokens (`context_parallel_logprobs`, `context_parallel_values`);
the per-token results are gathered over the group (a few floats per token), so every rank of the group holds the
micro-batch's whole [B, T] outputs, and computes the same loss from them.

Gradients: the exchange is an autograd function whose backward is the reverse exchange; the gather's backward keeps
this rank's part of the (same on every rank) gradient. A rank's parameter gradients are then its positions' share;
their sum over the group is the one-rank gradient (so a data-parallel average over world_size ranks must be scaled by
world_size, not by the data-parallel size: C ranks hold parts of the same samples).

The training step (`PPOModule`) runs every forward through `logprobs_and_entropy` / `values_of`, which take this
path when the rank has a group; its reductions of samples run over the data-parallel group
(`distributed.use_data_parallel_group`), and its loss is scaled by every rank (`Counts.ranks`) before DDP or FSDP2
average the gradients over them. The group's rank 0 generates the group's samples and broadcasts them to the others
(lit_ppo/rollout/context_group.py), so every rank of a group trains the identical batch.

Not built yet (refused in one line, `check_model` and `config.strategy.validate_context_parallel`): ring attention
(heads not divisible by C), sliding windows, attention sinks, flash/flex kernels, rollout workers.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import create_causal_mask

from lit_ppo.config.strategy import check_context_parallel_model
from lit_ppo.distributed import all_to_all
from lit_ppo.errors import ConfigError
from lit_ppo.training.batching import MicroBatch
from lit_ppo.training.models import critic_values, response_logprobs_and_entropy, scatter_responses
from lit_ppo.training.shared_prefix import attention_mask_for, segment_mask

ULYSSES = "lit_ppo_ulysses"
"""The attention implementation's name in transformers' AttentionInterface while a context-parallel forward runs."""

_ACTIVE: list[tuple[Any, str, bool, Any]] = []  # (group, wrapped implementation, whole rows causal, config) running now


@dataclass(frozen=True)
class ContextGroup:
    """This rank's context-parallel group: its process group, its C ranks and this rank's place among them."""

    group: Any
    size: int
    rank: int

    @classmethod
    def of(cls, topology) -> ContextGroup:
        """The group of a `RankTopology` whose groups are built (`RankTopology.with_groups`)."""
        return cls(topology.context_parallel_group, topology.context_parallel_size, topology.context_parallel_rank)


# ---------------------------------------------------------------- the exchange


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, split_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.split_dim, ctx.gather_dim = group, split_dim, gather_dim
        return all_to_all(x, group, split_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # the gradient of chunk j of x (sent to rank j) is the chunk of rank j's gradient that came from here
        return all_to_all(grad, ctx.group, ctx.gather_dim, ctx.split_dim), None, None, None


def exchange(x: Tensor, group, split_dim: int, gather_dim: int) -> Tensor:
    """`all_to_all`, differentiable: its backward is the reverse exchange (a collective in both passes)."""
    return _Exchange.apply(x, group, split_dim, gather_dim)


def ulysses_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers' attention function contract: query [B, H, S, D], key and value [B, Hkv, S, D] of this rank's S
    positions; returns [B, S, H, D]. Exchanged to [B, H/C, C*S, D] (the whole rows, H/C heads: query head group j
    meets key head group j, as grouped-query attention pairs them), attended by the wrapped kernel under the whole
    row's mask, exchanged back."""
    group, inner, causal, _ = _ACTIVE[-1]
    if kwargs.get("sliding_window") is not None or getattr(module, "sinks", None) is not None:
        raise ConfigError(
            "strategy.context_parallel_size > 1: this model's attention has a sliding window or sinks, which the "
            "Ulysses exchange does not handle yet; fix: strategy.context_parallel_size=1"
        )
    if inner == "eager":  # each modeling file has its own eager function (transformers registers none)
        attend = sys.modules[type(module).__module__].eager_attention_forward
    else:
        attend = AttentionInterface._global_mapping[inner]
    if causal:  # the whole rows' mask is causality alone (transformers' own skip, sdpa): the kernel's is_causal
        attention_mask, kwargs = None, {**kwargs, "is_causal": True}  # (the mask given is the local rows')
    query, key, value = (exchange(t, group, 1, 2) for t in (query, key, value))
    output, _ = attend(module, query, key, value, attention_mask, **kwargs)  # [B, C*S, H/C, D]
    return exchange(output, group, 1, 2), None


AttentionInterface.register(ULYSSES, ulysses_attention)


def check_model(config, size: int) -> None:
    """What the exchange needs of a model (`check_context_parallel_model`), on its loaded config."""
    check_context_parallel_model(config, size, config._attn_implementation)


@contextmanager
def ulysses(model: torch.nn.Module, cp: ContextGroup, causal: bool = False) -> Iterator[None]:
    """`model`'s forwards inside run the exchange around its attention kernel (the one it was loaded with); `causal`:
    the whole rows' mask is causality alone, left to the kernel (`local_micro_batch` gave no mask). Layers under
    gradient checkpointing recompute inside it too (`_recompute_inside`)."""
    config = model.config
    check_model(config, cp.size)
    _recompute_inside(model)
    with _exchanging(config, (cp.group, config._attn_implementation, causal, config)):
        yield


@contextmanager
def _exchanging(config, active: tuple) -> Iterator[None]:
    """`config`'s attention is the exchange around `active`'s kernel while inside."""
    before = config._attn_implementation
    _ACTIVE.append(active)
    config._attn_implementation = ULYSSES
    try:
        yield
    finally:
        config._attn_implementation = before
        _ACTIVE.pop()


def _recompute_contexts():
    """torch.utils.checkpoint's `context_fn`, called where a checkpointed layer runs forward: the backward's recompute
    of a layer that ran inside `ulysses` runs inside it again (the same group, kernel and mask rule; the backward runs
    after `ulysses` has exited, and the layer's attention reads the config's implementation when it runs)."""
    if not _ACTIVE:
        return nullcontext(), nullcontext()
    active = _ACTIVE[-1]
    return nullcontext(), _exchanging(active[3], active)


def _recompute_inside(model: torch.nn.Module) -> None:
    """Give the checkpointing function of `model`'s checkpointed layers (transformers' `GradientCheckpointingLayer`,
    non-reentrant as `models.prepare_for_training` enables it) `_recompute_contexts`, once."""
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and function is not None:
            if getattr(function, "keywords", {}).get("context_fn") is not _recompute_contexts:
                module._gradient_checkpointing_func = functools.partial(function, context_fn=_recompute_contexts)


# ---------------------------------------------------------------- the split of a micro-batch


def _padded_columns(x: Tensor | None, columns: int, value: int) -> Tensor | None:
    if x is None or columns == 0:
        return x
    return torch.cat([x, x.new_full((x.shape[0], columns), value)], dim=1)


def local_micro_batch(model: torch.nn.Module, mb: MicroBatch, cp: ContextGroup) -> MicroBatch:
    """This rank's part of `mb` as a packed-style micro-batch: its S = L'/C positions of every row (rows padded on the
        right to L', a multiple of C: positions nothing real attends to), the whole rows' 4-D mask (None where it is
    causality alone: the kernel's is_causal, as in the one-rank forward, whose sdpa then needs no [L, L] mask; the
    shared-prefix layout's by `_shared_prefix_mask`, but for one sample, whose rule is causality alone), and
    `head_index` /
        `response_ids` [1, n_r] / `response_mask` of the response tokens whose predicting position is here, in the order
        of `mb`'s response tokens (`_head_positions`)."""
    rows, length = mb.input_ids.shape
    width = -(-length // cp.size) * cp.size  # L'
    extra = width - length
    input_ids = _padded_columns(mb.input_ids, extra, 0)
    position_ids = mb.position_ids
    if extra:  # packed: a sequence of its own; padded: masked out as keys
        tail = torch.arange(extra, device=position_ids.device).expand(rows, extra)
        position_ids = torch.cat([position_ids, tail], dim=1)
    if mb.segments is not None and mb.response_ids.shape[0] > 1:  # the shared-prefix layout: its own rule
        mask = _shared_prefix_mask(model, mb, width, cp)
    else:  # transformers' rule; also one sample laid out shared-prefix: its prompt, its response, causality alone
        attention = mb.attention_mask if mb.segments is None else None
        mask = _whole_rows_mask(model, attention, mb.position_ids)  # the one-rank forward's
        if mask is not None and extra:  # the columns added too: their own sequence (packed), masked out (padded)
            del mask
            mask = _whole_rows_mask(model, _padded_columns(attention, extra, 0), position_ids)
    S = width // cp.size
    columns = slice(cp.rank * S, (cp.rank + 1) * S)
    flat, targets = _head_positions(mb, width)
    row, column = flat // width, flat % width
    here = column // S == cp.rank
    local = row[here] * S + column[here] - cp.rank * S
    return MicroBatch(
        input_ids=input_ids[:, columns],
        attention_mask=mask,
        position_ids=position_ids[:, columns],
        response_ids=targets[here][None],
        response_mask=torch.ones((1, int(here.sum())), dtype=torch.float32, device=input_ids.device),
        prompt_width=0,
        head_index=local,
    )


def _whole_rows_mask(model: torch.nn.Module, attention: Tensor | None, position_ids: Tensor) -> Tensor | None:
    """transformers' own mask of whole rows (`create_causal_mask`: padding, causality, packed rows' block-diagonal
    rule): a 4-D mask, which transformers passes on as it is; or None where it is causality alone. Decided on the
    rows as the one-rank forward sees them: the columns `local_micro_batch` adds to make the width a multiple of C
    come after every real token, where causality alone keeps every real position from attending to them, so a row
    of causality alone stays without an [L, L] mask at any length (transformers, seeing the added columns' padding
    or restarted positions, would build one: 256 MiB of bool at 16k tokens, and sdpa a float copy per layer)."""
    rows, length = position_ids.shape
    embeds = torch.empty((rows, length, 1), dtype=model.dtype, device=position_ids.device)  # shape and dtype only
    return create_causal_mask(
        config=model.config,
        inputs_embeds=embeds,
        attention_mask=attention,
        past_key_values=None,
        position_ids=position_ids,
    )


def _shared_prefix_mask(model: torch.nn.Module, mb: MicroBatch, width: int, cp: ContextGroup):
    """The shared-prefix layout's whole-row mask (`shared_prefix.segment_mask`, the one-rank forward's) over rows
    padded to `width`, the added positions a segment of their own (nothing real attends to them), in the form the
    kernel the model was loaded with takes (`shared_prefix.attention_mask_for`: boolean for sdpa, additive for
    eager)."""
    check_model(model.config, cp.size)  # before a kernel's own mask (flex attention's) is built
    segments = mb.segments  # [2, R, L]
    extra = width - segments.shape[2]
    if extra:
        tail = segments.new_full((2, segments.shape[1], extra), int(segments[0].max()) + 1)
        segments = torch.cat([segments, tail], dim=2)
    return attention_mask_for(model, replace(mb, attention_mask=segment_mask(segments), segments=segments))


def _head_positions(mb: MicroBatch, width: int) -> tuple[Tensor, Tensor]:
    """([n] flat positions in rows of `width` whose hidden states predict a response token, [n] those tokens), in the
    order of `mb`'s [B, T] response entries: all of them padded (prompts end at column P), the masked ones packed."""
    length = mb.input_ids.shape[1]
    if mb.packed:
        flat = mb.head_index
        return flat // length * width + flat % length, mb.response_ids[mb.response_mask > 0]
    B, T = mb.response_ids.shape
    columns = mb.prompt_width - 1 + torch.arange(T, device=mb.input_ids.device)
    flat = torch.arange(B, device=columns.device)[:, None] * width + columns[None]
    return flat.reshape(-1), mb.response_ids.reshape(-1)


# ---------------------------------------------------------------- gathering the per-token outputs


class _GatherParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: Tensor, sizes: list[int], cp: ContextGroup) -> Tensor:
        padded = part.new_zeros(max(sizes))
        padded[: part.numel()] = part
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=cp.group)
        ctx.start, ctx.size = sum(sizes[: cp.rank]), sizes[cp.rank]
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        # every rank of the group computes the same loss from the gathered tensor: its gradient is the same
        # everywhere, and this rank's part is what flows back into its own positions
        return grad[ctx.start : ctx.start + ctx.size], None, None


def gathered_responses(part: Tensor, mb: MicroBatch, cp: ContextGroup, width: int) -> Tensor:
    """The group's [n_r] per-token outputs (each rank's `local_micro_batch` response tokens) as `mb`'s [B, T]."""
    flat, _ = _head_positions(mb, width)
    owner = flat % width // (width // cp.size)
    sizes = [int((owner == r).sum()) for r in range(cp.size)]
    order = torch.argsort(owner, stable=True)  # gathered entry k is response entry order[k]
    values = _GatherParts.apply(part.reshape(-1), sizes, cp)[torch.argsort(order)]
    if mb.packed:
        return scatter_responses(values, mb.response_mask)
    return values.view(mb.response_ids.shape)


def _width(mb: MicroBatch, cp: ContextGroup) -> int:
    return -(-mb.input_ids.shape[1] // cp.size) * cp.size


def context_parallel_logprobs(
    model: torch.nn.Module, mb: MicroBatch, cp: ContextGroup, temperature: float
) -> tuple[Tensor, Tensor]:
    """`models.response_logprobs_and_entropy` of `mb`, computed by the C ranks of `cp` together (a collective): [B, T]
    log-probs and entropies, the same on every rank of the group."""
    local = local_micro_batch(model, mb, cp)
    with ulysses(model, cp, causal=local.attention_mask is None):
        logp, entropy = response_logprobs_and_entropy(model, local, temperature)  # [1, n_r] each
    width = _width(mb, cp)
    return gathered_responses(logp, mb, cp, width), gathered_responses(entropy, mb, cp, width)


def context_parallel_values(critic: torch.nn.Module, mb: MicroBatch, cp: ContextGroup) -> Tensor:
    """`models.critic_values` of `mb`, computed by the C ranks of `cp` together (a collective): [B, T] values."""
    local = local_micro_batch(critic, mb, cp)
    with ulysses(critic, cp, causal=local.attention_mask is None):
        values = critic_values(critic, local)  # [1, n_r]
    return gathered_responses(values, mb, cp, _width(mb, cp))


# ---------------------------------------------------------------- the training step's forwards


def logprobs_and_entropy(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, cp: ContextGroup | None = None
) -> tuple[Tensor, Tensor]:
    """[B, T] log-probs and entropies of `mb`: `models.response_logprobs_and_entropy`, or under context parallelism
    (`cp` given) the group's `context_parallel_logprobs` (a collective over the group)."""
    if cp is None:
        return response_logprobs_and_entropy(model, mb, temperature)
    return context_parallel_logprobs(model, mb, cp, temperature)


def values_of(critic: torch.nn.Module, mb: MicroBatch, cp: ContextGroup | None = None) -> Tensor:
    """[B, T] values of `mb`: `models.critic_values`, or the group's `context_parallel_values`."""
    return critic_values(critic, mb) if cp is None else context_parallel_values(critic, mb, cp)
