"""The typed experience of a rollout step and the tensor work on it (advantages and returns, the rollout-mismatch
correction, loss denominators, the adaptive KL coefficient's step); the micro-batches it is computed on are
lit_ppo/training/batching.py's.

Shapes: N samples of this rank's rollout batch, P the widest prompt of a micro-batch, T the longest
response (of the whole batch for `Experience`, of the micro-batch for `MicroBatch`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lit_ppo import algorithms as algo
from lit_ppo.batch import RolloutBatch
from lit_ppo.distributed import all_gather_padded, global_max, global_sum
from lit_ppo.errors import RolloutMismatchError
from lit_ppo.topology import RankTopology
from lit_ppo.training.numerics import sampler_mismatch_metrics

# Debugging aid: a directory where make_experience saves each rank's advantages of every rollout step
# (with the samples' global positions), e.g. to check that they do not depend on the number of ranks.
DUMP_ADVANTAGES_ENV = "LIT_PPO_DUMP_ADVANTAGES"


@dataclass(frozen=True)
class Experience:
    """One rollout step's experience, computed once and read by every PPO epoch.

    A field whose model does not exist in the run is None (no reference: no `ref_logp` and no `kl`;
    no critic: no `values`), so that no code can mistake zeros for log-probs or values."""

    mask: Tensor  # [N, T] 1.0 on response tokens
    # [N, T] the actor's log-probs before this rollout step's updates. None while training an exactly on-policy
    # update (StepPlan.old_logprobs.source "training forward"): each training forward's own log-probs, detached, are
    # the old ones; train_on_experience returns an experience with them afterwards (for the KL and mismatch metrics).
    old_logp: Tensor | None
    advantages: Tensor  # [N, T]
    returns: Tensor  # [N, T]
    rewards: Tensor  # [N] one reward per sample
    ref_logp: Tensor | None = None  # [N, T] the reference model's log-probs
    kl: Tensor | None = None  # [N, T] per-token KL estimate to the reference, zero off the mask
    values: Tensor | None = None  # [N, T] the critic's values before this rollout step's updates
    rollout_logp: Tensor | None = None  # [N, T] the sampler's (vLLM's) log-probs; None when the batch has none
    logprob_abs_diff_mean: Tensor | None = None  # [] global mean |old_logp - rollout_logp| over response tokens
    logprob_abs_diff_max: Tensor | None = None  # [] its global maximum
    # the same tokens' mismatch by depth and the share outside [0.9, 1.1] (`numerics.sampler_mismatch_metrics`), global
    sampler_mismatch: dict[str, float] | None = None
    rc_weights: Tensor | None = None  # [N, T] rollout-correction weight of each token's policy loss (the mask when off)
    loss_mask: Tensor | None = None  # [N, T] the tokens the policy loss keeps (the mask unless MIS drops some)
    teacher_logp: Tensor | None = None  # [N, T] on-policy distillation's teacher's log-probs of the sampled tokens

    def rows(self, idx: list[int], width: int) -> Experience:
        """The samples `idx`, their [N, T] fields cut to the micro-batch's `width` response columns."""

        def cut(x: Tensor | None) -> Tensor | None:
            if not isinstance(x, Tensor) or x.dim() == 0:
                return x
            return x[idx] if x.dim() == 1 else x[idx, :width]

        return Experience(**{f.name: cut(getattr(self, f.name)) for f in dataclasses.fields(self)})


def rollout_logp_tensor(rollout_logprobs: list[list[float]], mask: Tensor) -> Tensor:
    """The sampler's per-token log-probs as an [N, T] float32 tensor like `mask`, zero past each response."""
    rollout_logp = torch.zeros(mask.shape, device=mask.device, dtype=torch.float32)
    for i, logprobs in enumerate(rollout_logprobs):
        rollout_logp[i, : len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
    return rollout_logp


def prompt_lengths(batch: RolloutBatch) -> Tensor:
    """[N] each sample's prompt tokens: where its response starts in the whole sequence."""
    return torch.tensor([len(p) for p in batch.prompt_ids], dtype=torch.long)


def teacher_metrics(exp: Experience) -> dict[str, float]:
    """On-policy distillation's per-step metrics over the global batch's response tokens: `teacher/reverse_kl`, the
    mean of log p_student - log p_teacher (the estimate of KL(student || teacher) the advantage is made of; 0 when the
    student samples as the teacher would), and `teacher/logprob_gap`, the mean |log p_student - log p_teacher| (0 only
    where every token agrees, where the mean may cancel). Empty without a teacher or before the old log-probs exist."""
    if exp.teacher_logp is None or exp.old_logp is None:
        return {}
    gap = (exp.old_logp - exp.teacher_logp) * exp.mask  # [N, T]
    total = global_sum(torch.stack([gap.sum(), gap.abs().sum(), exp.mask.sum()]).double())
    tokens = total[2].clamp(min=1)
    return {"teacher/reverse_kl": float(total[0] / tokens), "teacher/logprob_gap": float(total[1] / tokens)}


def rollout_correction(exp: Experience, rc) -> tuple[Tensor, Tensor, dict]:
    """Weights on the policy loss for the mismatch between vLLM's sampling log-probs and the old log-probs, the
    tokens the policy loss keeps, and their statistics (`ppo.rollout_correction`); all tokens with weight 1 when off."""
    mask = exp.mask
    if not rc.active():
        return mask.clone(), mask.clone(), {}
    if exp.rollout_logp is None:  # made by make_experience from batch.rollout_logprobs
        raise ValueError(
            f"ppo.rollout_correction.mode={rc.mode} needs the sampler's log-probs, but this rollout batch "
            "has none (not generated by vLLM); fix: set ppo.rollout_correction.mode=none"
        )
    return algo.rollout_correction(
        exp.old_logp,
        exp.rollout_logp,
        mask,
        mode=rc.mode,
        level=rc.level,
        tis_cap=rc.tis_cap,
        mis_low=rc.mis_low,
        mis_high=rc.mis_high,
        global_sum=global_sum,
        global_max=global_max,
    )


def dump_experience(directory: Path, batch: RolloutBatch, exp: Experience, rank: int, world_size: int) -> None:
    """Save this rank's experience of one rollout step (see DUMP_ADVANTAGES_ENV)."""
    directory.mkdir(parents=True, exist_ok=True)
    fields = {k: getattr(exp, k) for k in ("rewards", "mask", "advantages", "returns", "values")}
    torch.save(
        {
            "rollout_step": batch.rollout_step,
            "rank": rank,
            "world_size": world_size,
            "prompt_positions": batch.prompt_positions,
            "dataset_indices": batch.dataset_indices,
            "response_ids": batch.response_ids,
            **{k: v.cpu() for k, v in fields.items() if v is not None},
        },
        directory / f"rollout_step={batch.rollout_step:06d}.rank{rank}.pt",
    )


def current_version_tokens(batch, mask: Tensor) -> Tensor:
    """[N, T] `mask` where the batch's own policy version (its rollout step) generated the token: partial rollouts'
    version spans (`RolloutBatch.version_spans`); without them the samples of that version (`policy_versions`: a stale
    batch of rollout workers at k > 0 has none but a refill round's), or the mask itself where a batch has no versions.
    The sampler's log-probs of those tokens are of the weights the trainer starts the step from, so they bound a failed
    weight sync; a carried or stale token's differ by the updates since."""
    if batch.version_spans is None:
        if batch.policy_versions is None:
            return mask
        own = torch.tensor([v == batch.rollout_step for v in batch.policy_versions], dtype=mask.dtype)
        return mask * own.to(mask.device)[:, None]
    current = torch.zeros_like(mask)
    for i, spans in enumerate(batch.version_spans):
        ends = [start for start, _ in spans[1:]] + [mask.shape[1]]
        for (start, version), end in zip(spans, ends):
            if version == batch.rollout_step:
                current[i, start:end] = 1.0
    return current * mask


def sampler_numerics(batch, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """The sampler-mismatch numerics (`numerics.sampler_mismatch_metrics`: by depth, and the share outside the band)
    on the tokens of the batch's own policy version only (`current_version_tokens`): a carried token of partial
    rollouts (early in its response) or a stale batch's differs by the updates since its version, which is staleness,
    not numerics. A batch with no such token (rollout workers at k > 0) logs none (a collective: every rank calls it)."""
    own = current_version_tokens(batch, mask)  # [N, T]
    return sampler_mismatch_metrics(old_logp, rollout_logp, own, prompt_lengths(batch), global_sum)


def check_rollout_logprobs(batch, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, max_logprob_abs_diff):
    """Mean and max |trainer old log-prob - vLLM log-prob| over the global batch's response tokens (0-dim
    tensors); over `max_logprob_abs_diff` (rollout.max_logprob_abs_diff) on the guarded tokens the run stops: the
    engine is not sampling from the actor being trained (a weight sync that silently failed) or the two compute
    different distributions. Guarded: with partial rollouts the tokens of the batch's own policy version (its version
    spans, `current_version_tokens`: a carried token's differ by the updates since), otherwise every response token."""
    diff = (old_logp - rollout_logp).abs() * mask  # [N, T]
    total = global_sum(torch.stack([diff.sum(), mask.sum()]).double())
    mean = total[0] / total[1].clamp(min=1)
    largest = global_max(
        diff.max().double() if diff.numel() else torch.zeros((), dtype=torch.float64, device=diff.device)
    )
    if max_logprob_abs_diff is None:
        return mean, largest
    guarded, where = mean, ""
    if batch.version_spans is not None:  # partial rollouts: the carried tokens' differ by the updates since
        current = current_version_tokens(batch, mask)  # [N, T]
        counted = global_sum(torch.stack([(diff * current).sum(), current.sum()]).double())
        guarded, where = (
            counted[0] / counted[1].clamp(min=1),
            f" on its {int(counted[1])} tokens of version {batch.rollout_step}",
        )
    if float(guarded) > max_logprob_abs_diff:
        raise RolloutMismatchError(
            f"rollout step {batch.rollout_step + 1}: the trainer's log-probs of the sampled tokens differ from vLLM's by "
            f"{float(guarded):.3f} nats per token on average{where} (max {float(largest):.2f}), more than "
            f"rollout.max_logprob_abs_diff={max_logprob_abs_diff}: vLLM is not sampling from the actor being "
            "trained (a weight sync that failed) or samples another distribution (rollout.top_p < 1, rollout.dtype); "
            "the checkpoint of the step's start was saved; fix: raise rollout.max_logprob_abs_diff (null disables), "
            "then resume=auto (the resumed run syncs the weights anew; the other settings need a new run)"
        )
    return mean, largest


def old_logprobs_from_training(
    exp: Experience, captured: Tensor, captured_rows: Tensor, batch, ppo, max_logprob_abs_diff: float | None
) -> Experience:
    """Without an experience forward: `exp` with the log-probs the training forwards took before the first optimizer
    step (`captured`, rows marked in `captured_rows`) as its old log-probs (on-policy: every sample's) and its KL to
    the reference from them, and those log-probs checked against vLLM's (`check_rollout_logprobs`, on the captured
    samples; after the update, which a failed weight sync has then spoilt, but the run stops as with the forward). A
    new experience: `exp` is left as it was."""
    changes = {}
    if exp.old_logp is None:
        changes["old_logp"] = captured
        if exp.ref_logp is not None:
            changes["kl"] = algo.KL_ESTIMATORS[ppo.kl_estimator](captured - exp.ref_logp) * exp.mask
    if batch.rollout_logprobs is not None:
        rollout_logp = rollout_logp_tensor(batch.rollout_logprobs, exp.mask)
        mask = exp.mask * captured_rows[:, None]
        changes["logprob_abs_diff_mean"], changes["logprob_abs_diff_max"] = check_rollout_logprobs(
            batch, captured, rollout_logp, mask, max_logprob_abs_diff
        )
        changes["sampler_mismatch"] = sampler_numerics(batch, captured, rollout_logp, mask)
    return dataclasses.replace(exp, **changes)


class OldLogprobCapture:
    """Without an experience forward (`StepPlan.old_logprobs.source` "training forward" or "vLLM"): the log-probs of
    the training forwards before the first optimizer step, which are the actor's before the update (every sample's
    when on-policy), kept for the old log-probs, the KL to the reference and the check against vLLM's
    (`old_logprobs_from_training`). Each rank writes the rows it trained, of the global batch."""

    def __init__(self, mask: Tensor):  # [N, T] the global batch's response mask
        self.logp = torch.zeros_like(mask)  # [N, T]
        self.rows = torch.zeros(mask.shape[0], dtype=mask.dtype, device=mask.device)  # [N] 1.0 where captured
        self.open = True

    def add(self, idx: list[int], logp: Tensor) -> None:
        """The training forward's log-probs [B, t] (detached) of the samples `idx`, until `close`."""
        if self.open:
            self.logp[idx, : logp.shape[1]] = logp
            self.rows[idx] = 1.0

    def close(self) -> None:
        """After the first optimizer step: the forwards from here on are of the updated actor."""
        self.open = False

    def experience(self, exp: Experience, own: list[int], batch, ppo, max_logprob_abs_diff: float | None) -> Experience:
        """This rank's experience `exp` (its samples at `own` in the global batch) with the captured log-probs, gathered
        over the ranks (a collective): a new experience (`old_logprobs_from_training`)."""
        logp, rows = global_sum(self.logp)[own], global_sum(self.rows)[own]  # each row written by one rank
        return old_logprobs_from_training(exp, logp[:, : exp.mask.shape[1]], rows, batch, ppo, max_logprob_abs_diff)


def advantages_and_returns(
    rewards: Tensor,
    mask: Tensor,
    values: Tensor | None,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    ppo,
    *,
    kl_coef: float,
    group_size: int,
    teacher_logp: Tensor | None = None,
):
    """(KL to the reference [N, T] or None, advantages, returns) by `ppo.advantage_estimator`, with the KL penalty in
    the reward when `ppo.kl_mode=reward`. Statistics are global (`distributed.global_sum`). Without old log-probs yet
    (taken from the training forwards), the KL is computed after the update (`old_logprobs_from_training`): auto
    keeps the experience forward when the KL is in the reward. `teacher_logp` [N, T]: on-policy distillation's teacher
    (`algo.on_policy_distill`, whose student log-probs are the old ones)."""
    kl = (
        algo.KL_ESTIMATORS[ppo.kl_estimator](old_logp - ref_logp) * mask
        if ref_logp is not None and old_logp is not None
        else None
    )
    kl_penalty = kl_coef * kl if (kl is not None and ppo.kl_mode == "reward") else None
    advantages, returns = algo.ADVANTAGE_ESTIMATORS[ppo.advantage_estimator](
        rewards,
        mask,
        values=values,
        kl_penalty=kl_penalty,
        gamma=ppo.gamma,
        lam=ppo.lam,
        group_size=group_size,
        global_sum=global_sum,
        normalize=ppo.normalize_advantages,
        student_logp=old_logp,
        teacher_logp=teacher_logp,
        teacher_coef=ppo.distill.teacher_coef,
        reward_coef=ppo.distill.reward_coef,
        reward_estimator=ppo.distill.reward_estimator,
    )
    return kl, advantages, returns


def experience_from_forwards(
    batch,
    mask: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    values: Tensor | None,
    ppo,
    plan,
    *,
    kl_coef: float,
    max_logprob_abs_diff: float | None,
    teacher_logp: Tensor | None = None,
) -> tuple[Experience, dict[str, float]]:
    """The rollout batch's experience from the experience forwards' outputs ([N, T] each; None where the run has no
    such forward): vLLM's log-probs become the old ones where the plan takes them there (`plan.old_logprobs.source`)
    and are checked against the experience forward's otherwise; then the advantages and the rollout correction's
    weights. Also the correction's statistics, named for the log."""
    source = plan.old_logprobs.source
    rollout_logp = diff_mean = diff_max = mismatch = None
    if batch.rollout_logprobs is not None:
        rollout_logp = rollout_logp_tensor(batch.rollout_logprobs, mask)
        if source == "vLLM":
            old_logp = rollout_logp.clone()
        if source == "experience forward":  # otherwise checked against the training forwards (train_on_experience)
            diff_mean, diff_max = check_rollout_logprobs(batch, old_logp, rollout_logp, mask, max_logprob_abs_diff)
            mismatch = sampler_numerics(batch, old_logp, rollout_logp, mask)
    rewards = batch.rewards.to(mask.device)
    kl, advantages, returns = advantages_and_returns(
        rewards,
        mask,
        values,
        old_logp,
        ref_logp,
        ppo,
        kl_coef=kl_coef,
        group_size=plan.counts.n_samples_per_prompt,
        teacher_logp=teacher_logp,
    )
    exp = Experience(
        mask=mask,
        old_logp=old_logp,
        advantages=advantages,
        returns=returns,
        rewards=rewards,
        ref_logp=ref_logp,
        kl=kl,
        values=values,
        rollout_logp=rollout_logp,
        logprob_abs_diff_mean=diff_mean,
        logprob_abs_diff_max=diff_max,
        sampler_mismatch=mismatch,
        teacher_logp=teacher_logp,
    )
    rc_weights, loss_mask, stats = rollout_correction(exp, ppo.rollout_correction)
    exp = dataclasses.replace(exp, rc_weights=rc_weights, loss_mask=loss_mask)
    return exp, {f"rollout_correction/{k}": float(v) for k, v in stats.items()}


def global_experience(exp: Experience, picks: list[tuple[int, int]], topology: RankTopology) -> Experience:
    """Every rank's experience as one [N, T] experience of the global batch, its samples `picks` ((rank, sample index)
    each: `rank_samples.global_batch`'s order), widths padded with zeros to the widest rank's: what every rank trains
    its share of each global mini-batch from. A field that is None stays None, a 0-dim statistic (already global) as it
    is. One all-gather per field; on one process `exp` itself."""
    if not topology.distributed:
        return exp

    def gather(x: Tensor | None) -> Tensor | None:
        if not isinstance(x, Tensor) or x.dim() == 0:
            return x
        parts = all_gather_padded(x)
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + part.shape[0])
        rows = torch.tensor([offsets[rank] + i for rank, i in picks], device=x.device)
        return torch.cat(parts)[rows]

    return Experience(**{f.name: gather(getattr(exp, f.name)) for f in dataclasses.fields(exp)})


def loss_denominators(exp: Experience, indices: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """The mini-batch `indices`' response tokens, samples and policy-loss tokens (those the rollout correction keeps:
    all unless MIS drops some), of the global experience (`global_experience`: every rank holds the whole mini-batch's
    counts, so no all-reduce). The loss divides by the whole mini-batch's counts, not a micro-batch's or a rank's, so
    that accumulation and data parallelism do not change it (docs/reference.md section 3)."""
    mask = exp.mask[indices]
    samples = torch.tensor(float(len(indices)), dtype=mask.dtype, device=mask.device)
    return mask.sum(), samples, exp.loss_mask[indices].sum()


def kl_per_sequence(exp: Experience) -> float:
    """The global batch's mean KL to the reference per sequence (what the adaptive KL controller targets)."""
    count = torch.tensor(float(exp.mask.shape[0]), dtype=exp.mask.dtype, device=exp.mask.device)
    return float(global_sum((exp.kl * exp.mask).sum()) / global_sum(count))


def next_kl_coef(kl_coef: float, exp: Experience, ppo, samples_per_rollout_step: int) -> float:
    """The KL coefficient of the next rollout step: the adaptive controller's (`algo.adaptive_kl_coef`) on this batch's
    KL per sequence when ppo.adaptive_kl_target is set and the run has a reference; otherwise `kl_coef` unchanged."""
    if ppo.adaptive_kl_target is None or exp.kl is None:
        return kl_coef
    observed = kl_per_sequence(exp)
    return algo.adaptive_kl_coef(
        kl_coef, observed, ppo.adaptive_kl_target, samples_per_rollout_step, ppo.adaptive_kl_horizon
    )
