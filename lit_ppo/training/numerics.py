"""Long-context numerics, measured every rollout step: the sampler's log-probs against the trainer's by the token's
depth in its sequence (tinker-cookbook's numerics check) and the share of tokens whose probability ratio to the
sampler leaves [0.9, 1.1] (verl's measure), and the trainer against itself: the PPO ratio on the first mini-batch of
the first PPO epoch, which is exactly 1 (`FirstMiniBatchRatio`).

Shapes: N samples, T the longest response; K depth bins.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import Tensor

Reduce = Callable[[Tensor], Tensor]

# Edges of the depth bins in tokens (prompt included), powers of 4 from 512: [0, 512), [512, 2k), ..., [32k, inf).
DEPTH_EDGES = (0, 512, 2048, 8192, 32768)
RATIO_BAND = (0.9, 1.1)  # verl's band on the trainer / sampler probability ratio


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def depth_bin_names(edges: tuple[int, ...] = DEPTH_EDGES) -> list[str]:
    """The metric names of the bins: `rollout/logprob_abs_diff_depth_0-512`, ..., `..._depth_32k+` (the last open)."""
    bounds = [f"{_tokens(a)}-{_tokens(b)}" for a, b in zip(edges, edges[1:])] + [f"{_tokens(edges[-1])}+"]
    return [f"rollout/logprob_abs_diff_depth_{b}" for b in bounds]


def token_depths(prompt_lengths: Tensor, width: int) -> Tensor:
    """[N, width] each response token's position in its whole sequence (prompt tokens before it, and the response's
    own, an episode's observations included) from the prompts' lengths [N]."""
    return prompt_lengths[:, None] + torch.arange(width, device=prompt_lengths.device)[None, :]


def depth_binned_sums(abs_diff: Tensor, mask: Tensor, depth: Tensor, edges=DEPTH_EDGES) -> tuple[Tensor, Tensor]:
    """Sums of `abs_diff` [N, T] over the tokens of `mask` in each depth bin, and the tokens counted ([K] float64
    each): bin k holds edges[k] <= depth < edges[k + 1] (the last bin has no upper edge)."""
    bins = torch.bucketize(depth, torch.tensor(edges[1:], device=depth.device), right=True)  # [N, T] in 0..K-1
    weights = mask.double()
    sums = torch.zeros(len(edges), dtype=torch.float64, device=mask.device)
    counts = torch.zeros_like(sums)
    sums.index_add_(0, bins.flatten(), (abs_diff.double() * weights).flatten())
    counts.index_add_(0, bins.flatten(), weights.flatten())
    return sums, counts


def ratio_outside_count(log_ratio: Tensor, mask: Tensor, band: tuple[float, float] = RATIO_BAND) -> Tensor:
    """The tokens of `mask` whose ratio exp(`log_ratio`) lies outside `band` (closed), as a float64 count."""
    ratio = log_ratio.double().exp()
    outside = (ratio < band[0]) | (ratio > band[1])
    return (outside.double() * mask.double()).sum()


def sampler_mismatch_metrics(
    trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, prompt_lengths: Tensor, global_sum: Reduce
) -> dict[str, float]:
    """The global batch's mean |trainer - sampler log-prob| per depth bin (bins without tokens left out) and the
    share of its tokens whose ratio exp(trainer - sampler) leaves [0.9, 1.1] (`rollout/ratio_outside_band_fraction`;
    left out too where `mask` holds no token), from this rank's [N, T] tensors (one all-reduce)."""
    log_ratio = trainer_logp - sampler_logp  # [N, T]
    depth = token_depths(prompt_lengths.to(mask.device), mask.shape[1])
    sums, counts = depth_binned_sums(log_ratio.abs(), mask, depth)
    outside = ratio_outside_count(log_ratio, mask)
    total = global_sum(torch.cat([sums, counts, outside[None]]))
    K = len(DEPTH_EDGES)
    sums, counts, outside = total[:K], total[K : 2 * K], float(total[-1])
    row = {name: float(s / c) for name, s, c in zip(depth_bin_names(), sums, counts) if c > 0}
    if counts.sum() > 0:  # none where no token is masked in (a stale batch: `experience.sampler_numerics`)
        row["rollout/ratio_outside_band_fraction"] = outside / float(counts.sum())
    return row


def old_logprobs_used(logp: Tensor, inputs) -> Tensor:
    """The old log-probs the actor's loss (`loss.actor_loss`) divides by ([B, T]): the `LossInputs`', or, where they
    have none, the forward's own, detached. Exactly on-policy without an experience forward (these weights generated
    the batch), and on the first mini-batch of a step (`FirstMiniBatchRatio`), the old log-probs are these log-probs:
    ratio 1, the same gradient as with a forward that computed them before."""
    return inputs.old_logp if inputs.old_logp is not None else logp.detach()


class FirstMiniBatchRatio:
    """The PPO ratio on the first mini-batch of the first PPO epoch, before any optimizer step: exactly 1 in every
    layout and precision. Its old log-probs are the training forward's own, detached (`inputs`), as SkyRL's are of a
    forward laid out as the training forward's: the experience forward lays the samples out in other micro-batches
    (other widths, rows and partners), which in bf16 moves a token's log-prob by up to ~0.1 nat. Logged:
    `actor/ratio_first_minibatch_max_dev`, max |ratio - 1| of the loss there (0.0), and
    `actor/experience_ratio_first_minibatch_max_dev`, what it would be with the experience forward's old log-probs
    (the layout's and precision's own noise). Not taken where the old log-probs are the sampler's
    (ppo.old_logprobs=rollout: that ratio is the sampler mismatch, `rollout/logprob_abs_diff`)."""

    def __init__(self, source: str):  # StepPlan.old_logprobs.source
        self.open = source != "vLLM"
        self.max_dev = 0.0 if self.open else None  # of the loss's ratio
        # of the experience forward's old log-probs, where the run has that forward
        self.experience_dev = 0.0 if source == "experience forward" else None
        self.experience_logp: Tensor | None = None  # [B, T] the micro-batch's, until `add`

    def inputs(self, inputs):
        """A micro-batch's `LossInputs` with the old log-probs the loss uses: while open, none (the loss then takes
        the forward's own, detached); the experience forward's are kept for the diagnostic."""
        if not self.open:
            return inputs
        self.experience_logp = inputs.old_logp
        return first_minibatch_old_logp(inputs)

    def add(self, logp: Tensor, inputs) -> None:
        """One micro-batch's training-forward log-probs [B, T] and the `LossInputs` its loss read."""
        if not self.open or not inputs.response_mask.any():
            return
        keep = inputs.response_mask > 0
        # the ratio the loss computed, from the old log-probs it used (`old_logprobs_used`)
        self.max_dev = max(self.max_dev, max_ratio_dev(logp, old_logprobs_used(logp, inputs), keep))
        if self.experience_logp is not None:
            self.experience_dev = max(self.experience_dev, max_ratio_dev(logp, self.experience_logp, keep))

    def close(self) -> None:
        """After the first optimizer step: the forwards from here on are of the updated actor."""
        self.open = False

    def metrics(self, global_max: Reduce, device) -> dict[str, float]:
        """The metrics over all ranks (a collective where taken: every rank takes the same)."""
        if self.max_dev is None:
            return {}
        devs = [self.max_dev] + ([] if self.experience_dev is None else [self.experience_dev])
        devs = global_max(torch.tensor(devs, dtype=torch.float64, device=device)).tolist()
        names = ["actor/ratio_first_minibatch_max_dev", "actor/experience_ratio_first_minibatch_max_dev"]
        return dict(zip(names, devs))


def max_ratio_dev(logp: Tensor, old_logp: Tensor, keep: Tensor) -> float:
    """max |exp(logp - old_logp) - 1| over the tokens `keep` ([B, T] each)."""
    return float(((logp.detach().double() - old_logp.double()).exp() - 1).abs()[keep].max())


def first_minibatch_old_logp(inputs):
    """The first mini-batch's `LossInputs` without old log-probs: the loss takes the training forward's, detached."""
    return dataclasses.replace(inputs, old_logp=None)
