"""The start-up proof of ppo.packing for the model at hand: on the run's first micro-batch, the packed layout's outputs
are the padded layout's (`check_packing`, called once per process by `PPOModule.training_step`).

The packed forward differs from the padded one in two ways a model family can break: what mixes positions (attention,
and a hybrid's state-space or convolution layers) must keep to each sample from the packed position ids alone, and the
LM head runs only at the response positions (`models.packed_response_logits`). Either done otherwise gives another
distribution without an error: before the logits came from the model's own forward, tiny random Granite, Cohere and
MiniCPM3 models were 0.17, 0.20 and 1.6 nats per token off (docs/algorithms.md). Here the checked samples' log-probs,
and the critic's values and the hidden states its value head reads, in the packed micro-batch beside their neighbours,
are compared with each sample's own padded forward. The run stops in one line when they differ by more than the
precision's rounding.

With context parallelism (C > 1) both layouts run through the context-parallel forwards the run trains with
(`context_parallel.logprobs_and_entropy`, `values_of`): each rank holds 1/C of a row, as in training, never a whole
packed row (the memory C is there to divide), and the check proves the path that trains. The critic's hidden states
are then not compared (a rank's decoder sees only its own positions), its values are.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from lit_ppo.distributed import global_max
from lit_ppo.errors import PackingError
from lit_ppo.training.batching import MicroBatch
from lit_ppo.training.context_parallel import ContextGroup, logprobs_and_entropy, values_of
from lit_ppo.training.models import critic_values

# Bounds by the run's precision (lit_ppo/precision.py). The layouts differ only in the order of floating-point sums
# (attention over other row lengths, products of other shapes): in float32 at most 6e-6 nats per token and 1e-6
# relative on random models of several families (tests/training/test_packing.py); under bf16 (8 bits of mantissa) on CPU, 12
# layers of 256, 4e-4 to 5e-3 nats per token and 2e-3 to 1.1e-2 relative, more for peakier distributions. A model the
# packed path gets wrong is 0.1 nats per token and more apart. Log-probs: the mean |difference| over the checked
# response tokens, nats per token. The critic: the norm of the difference of its hidden states at those tokens (what
# the value head reads; the head starts at zero, so its values agree in any layout at first) over their norm, and the
# same of its values.
LOGPROB_TOLERANCE = {"32-true": 1e-3, "bf16-mixed": 5e-2, "bf16-true": 5e-2}
RELATIVE_TOLERANCE = {"32-true": 1e-3, "bf16-mixed": 5e-2, "bf16-true": 5e-2}
CHECKED_SAMPLES = 8  # of the first micro-batch, each a padded forward of its own


@dataclass
class LayoutDifference:
    """How far the packed layout's outputs are from the padded layout's on the checked samples (every rank's largest)."""

    logprob_mean: float  # mean |packed - padded| log-prob over the checked response tokens, nats per token
    logprob_max: float
    hidden_relative: float | None = None  # the critic's last hidden states at those tokens: |difference| / |padded|
    value_relative: float | None = None  # the critic's values there, the same way


@contextmanager
def decoder_outputs(model: torch.nn.Module) -> Iterator[list[Tensor]]:
    """The last hidden states ([rows, positions, H]) of each forward of `model`'s decoder inside the block."""
    captured: list[Tensor] = []
    handle = model.get_decoder().register_forward_hook(lambda _m, _a, output: captured.append(output[0]))
    try:
        yield captured
    finally:
        handle.remove()


def response_hidden_states(hidden: Tensor, mb: MicroBatch) -> Tensor:
    """The decoder's hidden states at the positions of `mb`'s response tokens (the value head's inputs), [B, T, H],
    zero off the response mask."""
    H = hidden.shape[-1]
    if mb.packed:
        at_head = hidden.reshape(-1, H)[mb.head_index]  # [n, H]
    else:
        T, start = mb.response_ids.shape[1], mb.prompt_width - 1
        at_head = hidden[:, start : start + T][mb.response_mask > 0]  # [n, H]
    out = torch.zeros(*mb.response_mask.shape, H, dtype=torch.float32, device=hidden.device)
    out[mb.response_mask > 0] = at_head.float()
    return out


def critic_outputs(critic: torch.nn.Module, mb: MicroBatch, cp: ContextGroup | None = None) -> tuple[Tensor, Tensor]:
    """The critic's values [B, T] and the hidden states its value head reads there [B, T, H], zero off the mask; with
    `cp` the context-parallel values and no hidden states ([B, T, 0]: a rank's decoder sees its own positions only)."""
    if cp is not None:
        values = values_of(critic, mb, cp) * mb.response_mask
        return values, values.new_zeros(*values.shape, 0)
    with decoder_outputs(critic) as captured:
        values = critic_values(critic, mb) * mb.response_mask
    return values, response_hidden_states(captured[-1], mb)


@torch.no_grad()
def layout_difference(
    actor: torch.nn.Module,
    critic: torch.nn.Module | None,
    packed: MicroBatch,
    alone: list[MicroBatch],
    temperature: float,
    cp: ContextGroup | None = None,
) -> LayoutDifference:
    """Packed (`packed`, whose first len(alone) samples are checked) against padded (`alone`: each of those samples by
    itself); maxima over ranks (a collective: every rank calls it, with as many samples). `cp`: through the
    context-parallel forwards (the critic's values only, not its hidden states)."""
    logp = logprobs_and_entropy(actor, packed, temperature, cp)[0]  # [B, T]
    if critic is not None:
        values, hidden = critic_outputs(critic, packed, cp)
    # sums over the checked response tokens: |d logp|, tokens, |d hidden|^2, |hidden|^2, |d value|^2, |value|^2
    sums = torch.zeros(6, dtype=torch.float64, device=logp.device)
    largest = torch.zeros((), dtype=torch.float64, device=logp.device)
    for b, mb in enumerate(alone):
        t, mask = mb.response_ids.shape[1], mb.response_mask[0]
        diff = (logprobs_and_entropy(actor, mb, temperature, cp)[0][0] - logp[b, :t]).abs() * mask
        sums[:2] += torch.stack([diff.sum(), mask.sum()]).double()
        largest = torch.maximum(largest, diff.max().double())
        if critic is not None:
            padded_values, padded_hidden = critic_outputs(critic, mb, cp)
            sums[2:] += torch.stack(
                [
                    (padded_hidden[0] - hidden[b, :t]).square().sum(),
                    padded_hidden.square().sum(),
                    (padded_values[0] - values[b, :t]).square().sum(),
                    padded_values.square().sum(),
                ]
            ).double()
    norms = sums[2:].sqrt()
    local = torch.stack(
        [
            sums[0] / sums[1].clamp(min=1),
            largest,
            norms[0] / norms[1] if norms[1] > 0 else norms[0],
            norms[2] / norms[3] if norms[3] > 0 else norms[2],
        ]
    )
    mean, largest, hidden_relative, value_relative = global_max(local).tolist()  # each figure's largest over ranks
    if critic is None:
        return LayoutDifference(mean, largest)
    return LayoutDifference(mean, largest, None if cp is not None else hidden_relative, value_relative)


def check_packing(
    actor: torch.nn.Module,
    critic: torch.nn.Module | None,
    packed: MicroBatch,
    alone: list[MicroBatch],
    temperature: float,
    precision: str,
    cp: ContextGroup | None = None,
) -> LayoutDifference:
    """Stop the run (PackingError, one line naming the model type and the fix) when the packed layout's outputs are
    not the padded layout's on the checked samples (`layout_difference`) within the precision's bounds; else log them.
    `cp`: the context-parallel group, whose forwards both layouts then run through."""
    found = layout_difference(actor, critic, packed, alone, temperature, cp)
    model_type = actor.config.model_type
    logprob_bound = LOGPROB_TOLERANCE.get(precision, max(LOGPROB_TOLERANCE.values()))
    relative_bound = RELATIVE_TOLERANCE.get(precision, max(RELATIVE_TOLERANCE.values()))
    where = f"the first micro-batch's first {len(alone)} samples"
    shared = packed is not None and packed.layout_tokens is not None  # the shared-prefix layout was checked
    fix = "fix: set ppo.packing=false (padded micro-batches)" + (
        ", or ppo.shared_prefix=false (each sample's prompt laid out)" if shared else ""
    )
    if not found.logprob_mean <= logprob_bound:  # a NaN fails too
        raise PackingError(
            f"ppo.packing: on this {model_type} model the packed and padded layouts of {where} give log-probs "
            f"{found.logprob_mean:.3g} nats per token apart on average (max {found.logprob_max:.3g}), more than "
            f"{precision}'s {logprob_bound:g}: the packed forward computes another distribution for it; {fix}"
        )
    for name, error in (("hidden states", found.hidden_relative), ("values", found.value_relative)):
        if error is not None and not error <= relative_bound:
            raise PackingError(
                f"ppo.packing: on this {model_type} model the critic's {name} at the response tokens of {where} are "
                f"{error:.3g} apart relative in the packed and padded layouts, more than {precision}'s "
                f"{relative_bound:g}; {fix}"
            )
    critic_line = "" if critic is None else f", the critic's values {found.value_relative:.2e} relative"
    if found.hidden_relative is not None:
        critic_line = (
            f", the critic's hidden states {found.hidden_relative:.2e} and values {found.value_relative:.2e} relative"
        )
    logging.getLogger("lit_ppo").info(  # run.log only: the console stays the plan, the progress and the evaluations
        "packing check (%s, %s, %s): log-probs %.2e nats per token apart on average (max %.2e)%s; within %g",
        model_type,
        precision,
        where,
        found.logprob_mean,
        found.logprob_max,
        critic_line,
        logprob_bound,
        extra={"console": False},
    )
    return found
