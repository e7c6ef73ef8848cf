"""The data that flows from a rollout into the PPO updates: packed micro-batches, the typed experience, and the
tensor work between them (advantages and returns, the rollout-mismatch correction, loss denominators, the adaptive
KL coefficient's step).

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
from lit_ppo.distributed import global_max, global_sum
from lit_ppo.errors import RolloutMismatchError

# Debugging aid: a directory where make_experience saves each rank's advantages of every rollout step
# (with the samples' global positions), e.g. to check that they do not depend on the number of ranks.
DUMP_ADVANTAGES_ENV = "LIT_PPO_DUMP_ADVANTAGES"


@dataclass
class MicroBatch:
    input_ids: Tensor  # [B, P+T] prompt left-padded, response right-padded
    attention_mask: Tensor  # [B, P+T]
    position_ids: Tensor  # [B, P+T]
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] float
    prompt_width: int  # P


def pack(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_id: int,
    device,
    policy_masks: list[list[int]] | None = None,
    expected_ids: list[list[int]] | None = None,
) -> MicroBatch:
    """Left-pad prompts and right-pad responses so every response starts at column P.

    `policy_masks` (multi-turn episodes): per response token 1 where the policy wrote it, 0 on observations;
    `response_mask` is then 1 on the policy's tokens only, so no loss, KL, entropy or token count reaches an
    observation (the model still reads them: they stay in the attention mask). `expected_ids`: per sample the
    ids vLLM was given and produced; every packed row must be exactly them (`check_packed_ids`)."""
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r) for r in response_ids))
    B = len(prompt_ids)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    policy = torch.zeros((B, T), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[b, P - len(p) : P] = torch.tensor(p)
        input_ids[b, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[b, P - len(p) : P + len(r)] = 1
        if policy_masks is not None:
            if len(policy_masks[b]) != len(r):
                raise RolloutMismatchError(
                    f"sample {b} of a micro-batch: {len(policy_masks[b])} policy-mask entries for "
                    f"{len(r)} response tokens; the episode's mask and ids were built apart"
                )
            policy[b, : len(r)] = torch.tensor(policy_masks[b], dtype=torch.float32)
    if expected_ids is not None:
        check_packed_ids(input_ids, attention, expected_ids)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention[:, P:].float()
    if policy_masks is not None:
        response_mask = response_mask * policy
    return MicroBatch(
        input_ids.to(device),
        attention.to(device),
        position_ids.to(device),
        input_ids[:, P:].to(device),
        response_mask.to(device),
        P,
    )


def padded_tokens(prompt_lengths: list[int], response_lengths: list[int], group: list[int]) -> int:
    """Positions `pack` lays out for the samples `group`: rows x (widest prompt + longest response, at least 1)."""
    return len(group) * (max(prompt_lengths[i] for i in group) + max(1, max(response_lengths[i] for i in group)))


def micro_batch_groups(
    prompt_lengths: list[int],
    response_lengths: list[int],
    indices: list[int],
    *,
    max_samples: int,
    max_tokens: int | None = None,
    min_count: int = 0,
) -> list[list[int]]:
    """Split the samples `indices` (one mini-batch, or the whole batch for the experience pass) into micro-batches.

    Both ways take the samples sorted by length (prompt + response, longest first; ties keep their order), so that
    samples of similar length share a micro-batch and pad little. The split does not change the update: the loss
    denominators are the mini-batch's (`loss_denominators`), and every micro-batch's gradient is summed into the
    same step. Fixed size (max_tokens None): consecutive runs of `max_samples` of that order. Token budget: each
    micro-batch filled while its padded size (`padded_tokens`) stays within `max_tokens`; a sample longer than the
    budget gets a micro-batch of its own. `min_count`: split the largest micro-batches in two until there are at
    least this many (data-parallel ranks must run as many forwards, FSDP gathers weights in each)."""
    order = sorted(indices, key=lambda i: prompt_lengths[i] + response_lengths[i], reverse=True)
    if max_tokens is None:
        return [order[start : start + max_samples] for start in range(0, len(order), max_samples)]
    groups: list[list[int]] = []
    for i in order:
        if groups and padded_tokens(prompt_lengths, response_lengths, groups[-1] + [i]) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    while len(groups) < min_count:
        largest = max(range(len(groups)), key=lambda g: len(groups[g]))
        if len(groups[largest]) < 2:
            raise ValueError(f"cannot make {min_count} micro-batches of {len(indices)} samples")
        group = groups.pop(largest)
        half = len(group) // 2
        groups[largest:largest] = [group[:half], group[half:]]
    return groups


def padding_fraction(prompt_lengths: list[int], response_lengths: list[int], groups: list[list[int]]) -> float:
    """Share of the positions the forwards of `groups` compute that are padding (0: none)."""
    positions = sum(padded_tokens(prompt_lengths, response_lengths, g) for g in groups)
    real = sum(prompt_lengths[i] + response_lengths[i] for g in groups for i in g)
    return 1 - real / positions if positions else 0.0


def check_packed_ids(input_ids: Tensor, attention: Tensor, expected_ids: list[list[int]]) -> None:
    """Each packed row's attended ids are exactly `expected_ids` (what vLLM was given and produced for the
    episode): the trainer computes log-probs of the tokens that were sampled, in the context they were sampled
    in. Cheap: one comparison per token, on the CPU tensors before they move to the device."""
    for b, expected in enumerate(expected_ids):
        packed = input_ids[b][attention[b].bool()].tolist()
        if packed != list(expected):
            first = next(
                (i for i, (x, y) in enumerate(zip(packed, expected)) if x != y), min(len(packed), len(expected))
            )
            raise RolloutMismatchError(
                f"sample {b} of a micro-batch: the ids the trainer packs differ from the ids vLLM was given and produced "
                f"at position {first} of {len(expected)} (packed {packed[first : first + 5]}, vLLM {list(expected)[first : first + 5]}); "
                "the trajectory was rebuilt instead of kept (e.g. decoded and re-encoded); rollout.check_token_ids=false "
                "turns this check off"
            )


@dataclass
class Experience:
    """One rollout step's experience, computed once and read by every PPO epoch.

    A field whose model does not exist in the run is None (no reference: no `ref_logp` and no `kl`;
    no critic: no `values`), so that no code can mistake zeros for log-probs or values."""

    mask: Tensor  # [N, T] 1.0 on response tokens
    # [N, T] the actor's log-probs before this rollout step's updates. None while training an exactly on-policy
    # update (StepPlan.old_logprobs_source "training forward"): each training forward's own log-probs, detached, are
    # the old ones; train_on_experience fills this field with them afterwards (for the KL and mismatch metrics).
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
    rc_weights: Tensor | None = None  # [N, T] rollout-correction weight of each token's policy loss (the mask when off)
    loss_mask: Tensor | None = None  # [N, T] the tokens the policy loss keeps (the mask unless MIS drops some)

    def rows(self, idx: list[int], width: int) -> Experience:
        """The samples `idx`, their [N, T] fields cut to the micro-batch's `width` response columns."""

        def cut(x: Tensor | None) -> Tensor | None:
            if x is None or x.dim() == 0:
                return x
            return x[idx] if x.dim() == 1 else x[idx, :width]

        return Experience(**{f.name: cut(getattr(self, f.name)) for f in dataclasses.fields(self)})


def rollout_logp_tensor(rollout_logprobs: list[list[float]], mask: Tensor) -> Tensor:
    """The sampler's per-token log-probs as an [N, T] float32 tensor like `mask`, zero past each response."""
    rollout_logp = torch.zeros(mask.shape, device=mask.device, dtype=torch.float32)
    for i, logprobs in enumerate(rollout_logprobs):
        rollout_logp[i, : len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
    return rollout_logp


def rollout_correction(exp: Experience, rc) -> tuple[Tensor, Tensor, dict]:
    """Weights on the policy loss for the mismatch between vLLM's sampling log-probs and the old log-probs, the
    tokens the policy loss keeps, and their statistics (`ppo.rollout_correction`); all tokens with weight 1 when off."""
    mask = exp.mask
    if rc.mode == "none":
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


def dump_experience(directory: Path, batch, exp: Experience, rank: int, world_size: int) -> None:
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


def check_rollout_logprobs(
    rollout_step: int, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, max_logprob_abs_diff: float | None
):
    """Mean and max |trainer old log-prob - vLLM log-prob| over the global batch's response tokens (0-dim
    tensors); over `max_logprob_abs_diff` (rollout.max_logprob_abs_diff) the run stops: the engine is not sampling from the actor being
    trained (a weight sync that silently failed) or the two compute different distributions."""
    diff = (old_logp - rollout_logp).abs() * mask  # [N, T]
    total = global_sum(torch.stack([diff.sum(), mask.sum()]).double())
    mean = total[0] / total[1].clamp(min=1)
    largest = global_max(
        diff.max().double() if diff.numel() else torch.zeros((), dtype=torch.float64, device=diff.device)
    )
    if max_logprob_abs_diff is not None and float(mean) > max_logprob_abs_diff:
        raise RolloutMismatchError(
            f"rollout step {rollout_step + 1}: the trainer's log-probs of the sampled tokens differ from vLLM's by "
            f"{float(mean):.3f} nats per token on average (max {float(largest):.2f}), more than "
            f"rollout.max_logprob_abs_diff={max_logprob_abs_diff}: vLLM is not sampling from the actor being "
            "trained (a weight sync that failed) or samples another distribution (rollout.top_p < 1, rollout.dtype); "
            "fix: check the weight sync and those settings, or raise rollout.max_logprob_abs_diff (null disables)"
        )
    return mean, largest


def old_logprobs_from_training(
    exp: Experience, captured: Tensor, captured_rows: Tensor, batch, ppo, max_logprob_abs_diff: float | None
) -> None:
    """Without an experience forward: the log-probs the training forwards took before the first optimizer step
    (`captured`, rows marked in `captured_rows`) become the experience's old log-probs (on-policy: every sample's)
    and its KL to the reference, and are checked against vLLM's (`check_rollout_logprobs`, on the captured samples;
    after the update, which a failed weight sync has then spoilt, but the run stops as with the forward)."""
    if exp.old_logp is None:
        exp.old_logp = captured
        if exp.ref_logp is not None:
            exp.kl = algo.KL_ESTIMATORS[ppo.kl_estimator](captured - exp.ref_logp) * exp.mask
    if batch.rollout_logprobs is not None:
        rollout_logp = rollout_logp_tensor(batch.rollout_logprobs, exp.mask)
        exp.logprob_abs_diff_mean, exp.logprob_abs_diff_max = check_rollout_logprobs(
            batch.rollout_step, captured, rollout_logp, exp.mask * captured_rows[:, None], max_logprob_abs_diff
        )


def rank_micro_batch_groups(batch, indices: list[int], ppo, plan, device) -> list[list[int]]:
    """This rank's micro-batches of `indices` (`micro_batch_groups`): ppo.micro_train_batch_size samples each, or by
    token budget (ppo.micro_train_max_tokens). Under data parallelism with a token budget every rank runs as many
    micro-batches as the rank that needs the most (FSDP gathers weights in each forward, a collective)."""
    max_samples, max_tokens = ppo.micro_train_batch_size, ppo.micro_train_max_tokens
    lengths = [len(p) for p in batch.prompt_ids], [len(r) for r in batch.response_ids]
    groups = micro_batch_groups(*lengths, indices, max_samples=max_samples, max_tokens=max_tokens)
    if max_tokens is not None and plan.data_parallel_size > 1:
        count = int(global_max(torch.tensor(float(len(groups)), device=device)))
        groups = micro_batch_groups(*lengths, indices, max_samples=max_samples, max_tokens=max_tokens, min_count=count)
    return groups


def packed_micro_batches(batch, groups: list[list[int]], pad_token_id: int, device):
    """(indices, MicroBatch) per group; episodes bring their policy masks and the ids the trainer must pack."""
    masks = getattr(batch, "policy_masks", None)
    expected = getattr(batch, "episode_ids", None)
    for idx in groups:
        yield (
            idx,
            pack(
                [batch.prompt_ids[i] for i in idx],
                [batch.response_ids[i] for i in idx],
                pad_token_id,
                device,
                policy_masks=None if masks is None else [masks[i] for i in idx],
                expected_ids=None if expected is None else [expected[i] for i in idx],
            ),
        )


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
):
    """(KL to the reference [N, T] or None, advantages, returns) by `ppo.advantage_estimator`, with the KL penalty in
    the reward when `ppo.kl_mode=reward`. Statistics are global (`distributed.global_sum`). Without old log-probs yet
    (taken from the training forwards), the KL is computed after the update (`old_logprobs_from_training`): auto
    keeps the experience forward when the KL is in the reward."""
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
) -> tuple[Experience, dict[str, float]]:
    """The rollout batch's experience from the experience forwards' outputs ([N, T] each; None where the run has no
    such forward): vLLM's log-probs become the old ones where the plan takes them there (`plan.old_logprobs_source`)
    and are checked against the experience forward's otherwise; then the advantages and the rollout correction's
    weights. Also the correction's statistics, named for the log."""
    source = plan.old_logprobs_source
    rollout_logp = diff_mean = diff_max = None
    if batch.rollout_logprobs is not None:
        rollout_logp = rollout_logp_tensor(batch.rollout_logprobs, mask)
        if source == "vLLM":
            old_logp = rollout_logp.clone()
        if source == "experience forward":  # otherwise checked against the training forwards (train_on_experience)
            diff_mean, diff_max = check_rollout_logprobs(
                batch.rollout_step, old_logp, rollout_logp, mask, max_logprob_abs_diff
            )
    rewards = batch.rewards.to(mask.device)
    kl, advantages, returns = advantages_and_returns(
        rewards, mask, values, old_logp, ref_logp, ppo, kl_coef=kl_coef, group_size=plan.n_samples_per_prompt
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
    )
    exp.rc_weights, exp.loss_mask, stats = rollout_correction(exp, ppo.rollout_correction)
    return exp, {f"rollout_correction/{k}": float(v) for k, v in stats.items()}


def loss_denominators(exp: Experience, indices: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """The mini-batch `indices`' response tokens, samples and policy-loss tokens (those the rollout correction keeps:
    all unless MIS drops some), summed over ranks. The loss divides by the whole mini-batch's counts, not a
    micro-batch's or a rank's, so that accumulation and data parallelism do not change it (docs/reference.md
    section 3)."""
    mask = exp.mask[indices]
    samples = torch.tensor(float(len(indices)), dtype=mask.dtype, device=mask.device)
    num_tokens, num_seqs, num_policy_tokens = global_sum(
        torch.stack([mask.sum(), samples, exp.loss_mask[indices].sum()])
    )
    return num_tokens, num_seqs, num_policy_tokens


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
