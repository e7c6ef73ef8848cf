"""PPO-family math as pure tensor functions, registered by name.

Conventions (all per-token tensors are over response tokens only):
- `mask`          [B, T] 1.0 on real response tokens, 0.0 on padding.
- `rewards`       [B]    one scalar per response (the verifier's score).
- `kl_penalty`    [B, T] per-token penalty already multiplied by the KL coefficient (zeros if none).
- `values`        [B, T] critic value of the state before each response token.
- samples of one prompt are contiguous: rows g*n .. g*n+n-1 form group g (n = group_size).
- `global_sum`    sums a tensor over data-parallel ranks (identity on one process), so every
                  batch statistic is global and results do not depend on how a batch is split.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

GlobalSum = Callable[[Tensor], Tensor]


def local_sum(x: Tensor) -> Tensor:
    return x


# ---------------------------------------------------------------- statistics


def masked_mean(x: Tensor, mask: Tensor, global_sum: GlobalSum = local_sum) -> Tensor:
    total = global_sum(torch.stack([(x * mask).sum(), mask.sum()]))
    return total[0] / total[1].clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, global_sum: GlobalSum = local_sum, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the valid tokens of the whole (global) batch; population std."""
    mean = masked_mean(x, mask, global_sum)
    var = masked_mean((x - mean) ** 2, mask, global_sum)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def last_valid_index(mask: Tensor) -> Tensor:
    """[B] the column of each row's last valid token (0 for a row without any). The mask may have holes: in a
    multi-turn episode the observations between the policy's turns are 0."""
    columns = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, columns, torch.zeros_like(columns)).max(-1).values if mask.numel() else columns.sum(-1)


def token_level_rewards(rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None = None) -> Tensor:
    """Per-token rewards [B, T]: -kl_penalty everywhere, plus the scalar reward on the last valid token."""
    token_rewards = torch.zeros_like(mask, dtype=rewards.dtype) if kl_penalty is None else -kl_penalty * mask
    last = last_valid_index(mask)  # [B]
    has_tokens = mask.sum(-1) > 0
    token_rewards = token_rewards.clone()
    token_rewards[torch.arange(len(rewards)), last] += rewards * has_tokens
    return token_rewards


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k >= t} gamma^(k-t) r_k over valid tokens; [B, T]. Positions off the mask (padding, the
    observations inside an episode) are skipped: the return carries over them unchanged and undiscounted."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t] > 0
        running = torch.where(valid, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def group_view(x: Tensor, group_size: int) -> Tensor:
    if x.shape[0] % group_size:
        raise ValueError(f"batch of {x.shape[0]} samples does not hold whole groups of {group_size}")
    return x.view(-1, group_size)


def no_kl_in_reward(name: str, kl_penalty: Tensor | None) -> None:
    """GRPO, Dr. GRPO and RLOO give one advantage per response from the task rewards of its group. A KL
    penalty summed into those rewards before the group statistics would give a group whose task rewards
    are all equal advantages of about +-1 from KL noise alone (GRPO divides by a std that is then the
    KL's); after them it would no longer be their estimator. So KL goes into the loss (kl_mode=loss)."""
    if kl_penalty is not None:
        raise ValueError(
            f"{name}: a KL penalty in the reward is not supported (it would give groups of equal task "
            "rewards non-zero advantages); put the KL in the loss (ppo.kl_mode=loss)"
        )


# ---------------------------------------------------------------- advantage estimators
# Each returns (advantages [B, T], returns [B, T]); padding positions are zero.


def gae(rewards, mask, *, values, kl_penalty=None, gamma=1.0, lam=0.95, global_sum=local_sum, normalize=True, **_):
    """Generalized advantage estimation (Schulman et al. 2016) with a critic.

    Over the valid tokens only: where the mask has holes (the observations between a multi-turn episode's
    policy turns), a policy token's next state is the next policy token, so the recursion
    delta_t = r_t + gamma V(next valid) - V_t, A_t = delta_t + gamma lam A(next valid) steps over the hole, as if
    the observation were part of the environment's transition. With a contiguous mask this is the usual GAE."""
    token_rewards = token_level_rewards(rewards, mask, kl_penalty)
    values = values * mask
    advantages = torch.zeros_like(token_rewards)
    last_gae = torch.zeros_like(token_rewards[:, 0])
    next_value = torch.zeros_like(last_gae)  # the value of the next valid token; 0 after the last
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(valid, delta + gamma * lam * last_gae, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = last_gae
    advantages = advantages * mask
    returns = (advantages + values) * mask
    if normalize:
        advantages = masked_whiten(advantages, mask, global_sum)
    return advantages, returns


def reinforce_pp(rewards, mask, *, kl_penalty=None, gamma=1.0, global_sum=local_sum, **_):
    """REINFORCE++: discounted token returns, whitened over the whole batch's valid tokens."""
    returns = discounted_returns(token_level_rewards(rewards, mask, kl_penalty), mask, gamma)
    return masked_whiten(returns, mask, global_sum), returns


def reinforce_pp_baseline(rewards, mask, *, group_size, kl_penalty=None, gamma=1.0, global_sum=local_sum, **_):
    """REINFORCE++-baseline: subtract the prompt-group mean TASK reward, then add the per-token KL penalty
    (OpenRLHF's order: the KL does not enter the group mean), then whiten over the batch."""
    grouped = group_view(rewards, group_size)
    centered = (grouped - grouped.mean(-1, keepdim=True)).reshape(-1)
    returns = discounted_returns(token_level_rewards(centered, mask, kl_penalty), mask, gamma)
    return masked_whiten(returns, mask, global_sum), returns


def grpo(rewards, mask, *, group_size, kl_penalty=None, eps=1e-6, **_):
    """GRPO: (r - group mean) / (group std + eps), unbiased std as in the paper's implementations."""
    no_kl_in_reward("grpo", kl_penalty)
    grouped = group_view(rewards, group_size)
    scores = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + eps)
    advantages = scores.reshape(-1, 1) * mask
    return advantages, advantages


def dr_grpo(rewards, mask, *, group_size, kl_penalty=None, **_):
    """Dr. GRPO: r - group mean, no std division (pair with seq-mean-token-sum-norm)."""
    no_kl_in_reward("dr_grpo", kl_penalty)
    grouped = group_view(rewards, group_size)
    advantages = (grouped - grouped.mean(-1, keepdim=True)).reshape(-1, 1) * mask
    return advantages, advantages


def rloo(rewards, mask, *, group_size, kl_penalty=None, **_):
    """RLOO: r_i - mean of the other n-1 rewards of the same prompt."""
    no_kl_in_reward("rloo", kl_penalty)
    grouped = group_view(rewards, group_size)
    others_mean = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)
    advantages = (grouped - others_mean).reshape(-1, 1) * mask
    return advantages, advantages


def on_policy_distill(
    rewards,
    mask,
    *,
    student_logp,
    teacher_logp,
    teacher_coef=1.0,
    reward_coef=0.0,
    reward_estimator="grpo",
    kl_penalty=None,
    **kwargs,
):
    """On-policy distillation (Agarwal et al. 2024; tinker-cookbook, prime-rl): each sampled token's advantage is the
    negative per-token reverse-KL estimate, -(log p_student - log p_teacher) [B, T], weighted by `teacher_coef`, plus
    `reward_coef` times the reward's advantage by `reward_estimator` (0: pure distillation). `student_logp` is the
    policy that sampled (the old log-probs), a constant here as the teacher's is; the log-ratio is clamped to
    +-LOG_RATIO_CLAMP like every other. No discount: a token's advantage is its own term (tinker's default)."""
    log_ratio = (student_logp - teacher_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    advantages = -teacher_coef * log_ratio * mask
    if reward_coef:
        reward_advantages, _ = ADVANTAGE_ESTIMATORS[reward_estimator](rewards, mask, kl_penalty=kl_penalty, **kwargs)
        advantages = advantages + reward_coef * reward_advantages * mask
    return advantages, advantages


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": gae,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "on_policy_distill": on_policy_distill,
}
GROUP_ESTIMATORS = ("reinforce_pp_baseline", "grpo", "dr_grpo", "rloo")
# Those that take a per-token KL penalty in the reward (kl_mode=reward); the others take KL in the loss only.
KL_IN_REWARD_ESTIMATORS = ("gae", "reinforce_pp", "reinforce_pp_baseline")


def count_uniform_groups(rewards: Tensor, group_size: int) -> int:
    """Groups whose rewards are all equal: their group-relative advantage is zero."""
    grouped = group_view(rewards, group_size)
    return int((grouped.max(-1).values == grouped.min(-1).values).sum())


# ---------------------------------------------------------------- clamps
# One token the policy has made very unlikely (or a rollout that does not match the trainer) can carry a
# log-ratio of -20 or less. exp() of it then dominates the batch: k3 = exp(20) = 4.9e8, and gradient clipping
# scales every other token's gradient down to nothing. As verl does, the policy ratio's log-ratio is clamped
# to +-LOG_RATIO_CLAMP; as OpenRLHF does, each KL estimate is clamped to +-KL_CLAMP (verl: k3 to +-10), its
# log-ratio first to +-LOG_RATIO_CLAMP so that exp() stays finite. Outside the clamps the gradient is 0.
LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0


# ---------------------------------------------------------------- KL estimators
# log_ratio = logp_policy - logp_reference, per token; each estimates KL(policy || reference), clamped (above).


def kl_k1(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-KL_CLAMP, KL_CLAMP)


def kl_k2(log_ratio: Tensor) -> Tensor:
    return (0.5 * log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) ** 2).clamp(max=KL_CLAMP)


def kl_k3(log_ratio: Tensor) -> Tensor:
    x = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(-x) - 1 + x).clamp(max=KL_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def adaptive_kl_coef(coef: float, observed_kl: float, target_kl: float, n_samples: int, horizon: int) -> float:
    """Proportional controller of Ziegler et al. (2019): move coef towards the target KL."""
    error = max(-0.2, min(0.2, observed_kl / target_kl - 1.0))
    return coef * (1.0 + error * n_samples / horizon)


# ---------------------------------------------------------------- policy losses (per token, [B, T])
# Each takes (logp, old_logp, advantages, mask) and the clip range and returns (per-token loss, per-token 1.0 where
# the clip was active); the caller aggregates the loss (`aggregate_loss`). `ppo.policy_loss` names one of POLICY_LOSSES.


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped surrogate with separate low/high clip and optional dual clip.

    Returns (per-token loss, per-token 1.0 where the clip was active). The log-ratio is clamped to
    +-LOG_RATIO_CLAMP before exp (see the clamps above). `mask` is not needed: every token stands alone."""
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).to(logp.dtype)
    if dual_clip is not None:
        bounded = torch.minimum(loss, -advantages * dual_clip)
        loss = torch.where(advantages < 0, bounded, loss)
    return loss, clip_active


def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    **_,
) -> tuple[Tensor, Tensor]:
    """GSPO (Zheng et al. 2025), token form: one ratio per sequence, s_i = exp(mean over its tokens of log r_t),
    clipped as a whole to [1 - low, 1 + high] (the paper: 3e-4 and 4e-4, since s_i moves far less than a token's
    ratio). Each token carries s_i,t = sg(s_i) * r_t / sg(r_t): its value is s_i, its gradient s_i * grad log pi_t,
    so with seq-mean-token-mean aggregation the gradient is exactly the sequence-level objective's,
    -A_i * grad s_i, and per-token advantages stay possible. `mask` [B, T] marks the tokens the mean runs over."""
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    # sg(log s_i) + log pi_t - sg(log pi_t): the value of log s_i, the gradient of log pi_t.
    ratio = torch.exp(logp - logp.detach() + seq_log_ratio.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).to(logp.dtype)


def cispo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    **_,
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped, stop-gradient importance ratio,
    loss_t = -sg(clip(r_t, 1 - low, 1 + high)) * A_t * log pi_t. Unlike PPO no token loses its gradient when its
    ratio leaves the range: the clip only bounds the weight (MiniMax-M1 leaves the low side open, low = 1).
    The clip counts as active where r_t lies outside the range."""
    ratio = torch.exp((logp - old_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    return -weight * advantages * logp, (weight != ratio).to(logp.dtype)


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
}


# ---------------------------------------------------------------- rollout-mismatch correction
# vLLM samples from its own numerics (kernels, bf16, a stale sync); the trainer's old log-probs are of another
# distribution. The ratio rho = pi_old(trainer) / pi_rollout(vLLM) of the sampled token corrects for it: TIS weights
# each token's loss by min(rho, cap) (bounded variance, some bias); MIS keeps rho where it lies in [low, high] and
# drops the token (weight 0, out of the loss and of its denominators) where it does not. At sequence level rho is
# the geometric mean of the sequence's token ratios, exp(mean_t log rho_t), one value for all its tokens, and MIS
# drops the whole sequence. The weights are constants (no gradient): both log-probs are of the rollout step.

ROLLOUT_CORRECTION_MODES = ("none", "tis", "mis")
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")


def actor_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    entropy: Tensor,
    *,
    policy_loss: str,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip: float | None = None,
    rc_weights: Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logp: Tensor | None = None,
    kl_estimator: str = "k1",
    kl_coef: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The actor's per-token loss [B, T]: the policy loss (`POLICY_LOSSES[policy_loss]`) weighted by the rollout
    correction (tokens MIS drops get weight 0), minus the entropy bonus, plus the KL to the reference when the KL is
    in the loss (`ref_logp` given). Returns (loss, weighted policy loss, clip indicator); aggregate with
    `aggregate_loss` over the kept tokens."""
    pg_tok, clipped = POLICY_LOSSES[policy_loss](
        logp,
        old_logp,
        advantages,
        mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        dual_clip=dual_clip,
    )
    if rc_weights is not None:
        pg_tok = pg_tok * rc_weights
    loss_tok = pg_tok
    if entropy_coef:
        loss_tok = loss_tok - entropy_coef * entropy
    if ref_logp is not None:
        loss_tok = loss_tok + kl_coef * KL_ESTIMATORS[kl_estimator](logp - ref_logp)
    return loss_tok, pg_tok, clipped


def rollout_correction(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    mode: str,
    level: str = "token",
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    global_sum: GlobalSum = local_sum,
    global_max: GlobalSum = local_sum,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Weights [B, T] for the policy loss, the tokens that stay in it [B, T], and statistics over the whole (global)
    batch: `weight_mean` and `weight_max` over the tokens kept, `masked_fraction` of the valid tokens dropped (mis),
    `truncated_fraction` of the valid tokens whose weight the cap cut (tis: rho > tis_cap). Padding gets weight 0 and
    is never kept."""
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r}; use one of {ROLLOUT_CORRECTION_MODES}")
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; use one of {ROLLOUT_CORRECTION_LEVELS}")
    log_ratio = (old_logp - rollout_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask
    if level == "sequence":
        log_ratio = (log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(mask)
    ratio = torch.exp(log_ratio) * mask
    if mode == "none":
        weights, keep = mask.clone(), mask.clone()
    elif mode == "tis":
        weights, keep = ratio.clamp(max=tis_cap), mask.clone()
    else:
        keep = mask * ((ratio >= mis_low) & (ratio <= mis_high)).to(mask.dtype)
        weights = ratio * keep
    truncated = mask * (ratio > tis_cap).to(mask.dtype) if mode == "tis" else torch.zeros_like(mask)
    sums = global_sum(torch.stack([(weights * keep).sum(), keep.sum(), mask.sum(), truncated.sum()]))
    largest = weights.masked_fill(keep == 0, 0.0).max() if weights.numel() else weights.new_zeros(())
    stats = {
        "weight_mean": sums[0] / sums[1].clamp(min=1),
        "weight_max": global_max(largest),
        "masked_fraction": 1 - sums[1] / sums[2].clamp(min=1),
        "truncated_fraction": sums[3] / sums[2].clamp(min=1),
    }
    return weights, keep, stats


# ---------------------------------------------------------------- reward shaping


def overlong_penalty(lengths: Tensor, *, max_response_tokens: int, buffer_tokens: int, penalty_factor: float) -> Tensor:
    """DAPO's soft overlong punishment per response [B] (added to its reward): 0 up to max_response_tokens -
    buffer_tokens tokens, then falling linearly to -penalty_factor at max_response_tokens, and -penalty_factor
    beyond it. A long response is penalized before it is cut off, by how far into the buffer it ran."""
    expected = max_response_tokens - buffer_tokens
    over = (lengths.to(torch.float64) - expected).clamp(min=0)
    return (-over / buffer_tokens * penalty_factor).clamp(min=-penalty_factor)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, *, value_clip: float | None
) -> tuple[Tensor, Tensor]:
    """0.5 * squared error, pessimistic over the clipped value when value_clip is set.

    Returns (per-token loss, per-token 1.0 where the clipped branch was chosen)."""
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(values)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype)


# ---------------------------------------------------------------- aggregation

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    `num_tokens` and `num_seqs` are the valid tokens and sequences of the whole mini-batch
    (over micro-batches and ranks). Passing them makes the sum of the micro-batch results equal the
    result on the whole mini-batch, which is what gradient accumulation needs. Left as None they are
    taken from this batch. `max_len` is the constant divisor of seq-mean-token-sum-norm
    (the generation budget in tokens); default: this batch's width."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; use one of {LOSS_AGG_MODES}")
    masked = loss * mask
    if mode == "token-mean":
        denominator = mask.sum() if num_tokens is None else num_tokens
        return masked.sum() / max(float(denominator), 1.0)
    seqs = mask.shape[0] if num_seqs is None else num_seqs
    if mode == "seq-mean-token-sum":
        per_seq = masked.sum(-1)
    elif mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
    else:
        per_seq = masked.sum(-1) / float(max_len or mask.shape[1])
    return per_seq.sum() / max(float(seqs), 1.0)


# ---------------------------------------------------------------- learning-rate schedule


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor
