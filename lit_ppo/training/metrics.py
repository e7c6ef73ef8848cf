"""Logged statistics: the rollout batch's (a pure function of the experience) and the updates' means.

Under data parallelism each rank holds a share of the rollout batch; `global_sum`/`global_max` (from
`lit_ppo.distributed`, identity on one process) make every statistic that of the whole batch.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from lit_ppo import algorithms as algo
from lit_ppo import distributed
from lit_ppo.batch import RolloutBatch
from lit_ppo.config import PPOConfig
from lit_ppo.plan import StepPlan
from lit_ppo.rewards.scorer import COUNT_METRICS
from lit_ppo.training.experience import Experience

GIB = 1024**3


def device_peak_memory_gib(device: torch.device) -> float | None:
    """The CUDA allocator's peak on `device` since the last call, in GiB, and the peak reset for the next: what a
    rollout step held at most (`perf/device_peak_memory_gib`: generation with rollout.engine=hf, experience, updates),
    the figure to set beside the plan's memory estimate (plan.json). None off CUDA (a CPU has no allocator peak to
    read; bench/lora_memory.py reads the process's resident memory instead)."""
    if device.type != "cuda":
        return None
    peak_bytes = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak_bytes / GIB


Reduce = Callable[[Tensor], Tensor]


def _identity(x: Tensor) -> Tensor:
    return x


def unbiased_variance(sum_: float, sum_sq: float, count: float) -> float:
    """Variance from a sum and a sum of squares, unbiased as Tensor.var(); 0 for fewer than two values."""
    return (sum_sq - sum_**2 / count) / (count - 1) if count > 1 else 0.0


def rollout_metrics(
    exp: Experience,
    truncated: Tensor,
    reward_metrics: dict[str, float],
    *,
    group_size: int | None = None,
    world_size: int = 1,
    count_metrics: frozenset[str] | set[str] = frozenset(),
    global_sum: Reduce = _identity,
    global_max: Reduce = _identity,
) -> dict[str, float]:
    """Statistics of the global rollout batch: every rank adds its samples' sums (one all-reduce).

    `truncated` [N] marks responses cut at the length budget; `reward_metrics` are this rank's means
    over its (equally many) samples, except the `count_metrics`, which are counts; `group_size` counts groups whose samples all got one reward (for
    the group estimators, where such a group has no learning signal). The KL appears only with a
    reference model (`exp.kl`), the explained variance only with a critic (`exp.values`)."""
    mask = exp.mask
    lengths = mask.sum(-1)  # [N]
    rewards = exp.rewards
    local = {
        "samples": len(rewards),
        "reward": rewards.sum(),
        "reward_sq": (rewards**2).sum(),
        "tokens": lengths.sum(),
        "truncated": truncated.sum(),
        "advantage": (exp.advantages * mask).sum(),
    }
    if exp.kl is not None:
        local["kl"] = (exp.kl * mask).sum()
    if exp.values is not None:
        valid = mask.bool()
        returns, values = exp.returns[valid], exp.values[valid]  # [tokens]
        local.update(
            returns=returns.sum(),
            returns_sq=(returns**2).sum(),
            residual=(returns - values).sum(),
            residual_sq=((returns - values) ** 2).sum(),
        )
    if group_size is not None:
        local["uniform_groups"] = algo.count_uniform_groups(rewards, group_size)
    for k, v in reward_metrics.items():  # per-rank means over equally many samples, or counts (summed)
        local[f"reward_{k}"] = v if k in count_metrics else v / world_size
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=mask.device) for v in local.values()])
    total = dict(zip(local, global_sum(stacked).tolist()))
    n, tokens = total["samples"], total["tokens"]

    row = {
        "rollout/reward_mean": total["reward"] / n,
        "rollout/reward_std": max(0.0, unbiased_variance(total["reward"], total["reward_sq"], n)) ** 0.5,
        "rollout/response_length_mean": tokens / n,
        "rollout/response_length_max": float(global_max(lengths.max().double())),
        "rollout/truncated_fraction": total["truncated"] / n,
        "rollout/generated_tokens": tokens,
    }
    if "kl" in total:
        row["rollout/kl_to_reference"] = total["kl"] / max(tokens, 1.0)
    row["rollout/advantage_mean"] = total["advantage"] / max(tokens, 1.0)
    if "uniform_groups" in total:
        row["rollout/uniform_reward_groups"] = int(total["uniform_groups"])
    if "residual" in total:
        unexplained = unbiased_variance(total["residual"], total["residual_sq"], tokens)
        row["critic/explained_variance"] = 1 - unexplained / max(
            unbiased_variance(total["returns"], total["returns_sq"], tokens), 1e-8
        )
    for k in reward_metrics:
        row[f"rollout/reward_{k}"] = total[f"reward_{k}"]
    return row


def episode_metrics(stats: dict[str, float], *, global_sum: Reduce = _identity, device=None) -> dict[str, float]:
    """Multi-turn episodes' statistics of the global rollout batch from each rank's sums (`episodes.episode_stats`):
    per-episode means of policy turns, tool calls, observation tokens and response tokens (turns and observations),
    the share of episodes that called a tool at least once, the environment's failures and the episodes cut at an
    observation that did not fit (counts)."""
    names = list(stats)
    total = dict(
        zip(
            names,
            global_sum(torch.tensor([float(stats[k]) for k in names], dtype=torch.float64, device=device)).tolist(),
        )
    )
    episodes = max(total["episodes"], 1.0)
    return {
        "rollout/turns_mean": total["turns"] / episodes,
        "rollout/tool_calls": total["tool_calls"] / episodes,
        "rollout/tool_call_rate": total["tool_call_episodes"] / episodes,
        "rollout/observation_tokens": total["observation_tokens"] / episodes,
        "rollout/episode_tokens": total["episode_tokens"] / episodes,
        "rollout/environment_errors": total["environment_errors"],
        "rollout/environment_timeouts": total["environment_timeouts"],
        # episodes cut at an observation that did not fit rollout.episodes.max_tokens (count; episodes.EpisodeLoop)
        "rollout/observations_cut": total["observations_cut"],
    }


class MeanOver:
    """Sums of named floats and the number of events they are averaged over.

    The divisor is explicit: `count()` closes one event (a micro-batch, an optimizer update); an
    event's values may be added in pieces before it closes (the value loss of an update arrives
    one micro-batch at a time)."""

    def __init__(self, event: str):
        self.event = event  # what one count is, for the reader: "micro-batch", "update"
        self.sums: dict[str, float] = {}
        self.events = 0

    def add(self, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def count(self) -> None:
        self.events += 1

    def means(self) -> dict[str, float]:
        return {k: v / max(1, self.events) for k, v in self.sums.items()}


def refill_and_returned_rounds(batch: RolloutBatch, plan: StepPlan) -> dict[str, int]:
    """Dynamic sampling with rollout workers: the step's rounds generated after its rewards (refill) and those requested
    ahead but not used (returned), counted against the rounds this batch's step was requested ahead with
    (`batch.rounds_ahead`): the plan's, or fewer where a checkpoint kept the step under other settings (raised
    ppo.dynamic_sampling.max_generation_rounds on resume), whose further rounds are refill rounds. {} without workers."""
    ahead = batch.rounds_ahead if batch.rounds_ahead is not None else plan.dynamic_sampling.rounds_requested_ahead
    if ahead is None:
        return {}
    return {
        "rollout/refill_rounds": max(0, batch.generation_rounds - ahead),
        "rollout/returned_rounds": max(0, ahead - batch.generation_rounds),
    }


def policy_version_lag(batch: RolloutBatch, *, global_sum: Reduce = _identity, device=None) -> float:
    """Rollout steps between the policy that generated each sample (its first token's, `policy_versions`) and the one
    the step starts from, the mean over the whole batch (every rank's share)."""
    lags = [batch.rollout_step - v for v in batch.policy_versions]
    total = global_sum(torch.tensor([float(sum(lags)), float(len(lags))], dtype=torch.float64, device=device))
    return float(total[0] / total[1].clamp(min=1))


def rollout_step_row(
    batch: RolloutBatch,
    exp: Experience,
    train_metrics: dict[str, float],
    timings: dict[str, float],
    *,
    counters: dict[str, int],
    plan: StepPlan,
    ppo: PPOConfig,
    extra: dict[str, float],
    global_sum: Reduce = _identity,
    global_max: Reduce = _identity,
) -> dict[str, float]:
    """The logged row of one rollout step (before evaluation): the counters, the rollout statistics, the updates'
    means (`train_metrics`), `extra` (rollout correction, KL coefficient), and the timings of the slowest rank
    (what the run waits for) with their sum. Groups with a single reward are counted for the group estimators."""
    group_size = plan.counts.n_samples_per_prompt if ppo.advantage_estimator in algo.GROUP_ESTIMATORS else None
    row = dict(counters)
    row.update(
        rollout_metrics(
            exp,
            batch.truncated,
            batch.reward_metrics,
            group_size=group_size,
            world_size=plan.counts.data_parallel_size,
            count_metrics=COUNT_METRICS,
            global_sum=global_sum,
            global_max=global_max,
        )
    )
    if batch.episode_stats:  # multi-turn episodes
        row.update(episode_metrics(batch.episode_stats, global_sum=global_sum, device=exp.mask.device))
    if exp.logprob_abs_diff_mean is not None:  # already global
        row["rollout/logprob_abs_diff"] = float(exp.logprob_abs_diff_mean)
        row["rollout/logprob_abs_diff_max"] = float(exp.logprob_abs_diff_max)
        row.update(exp.sampler_mismatch or {})  # by depth, and the share outside [0.9, 1.1]
    if plan.dynamic_sampling:  # global counts already, the same on every rank
        row.update(
            {
                "rollout/generation_rounds": batch.generation_rounds,
                "rollout/dropped_groups": batch.dropped_groups,
                "rollout/filled_groups": batch.filled_groups,
                "rollout/prompts_consumed": batch.prompts_consumed,
            }
        )
        row.update(refill_and_returned_rounds(batch, plan))
    row.update(extra)
    if batch.policy_versions is not None:  # every rank has them, or none: the collective is called on all ranks
        row["rollout/policy_version_lag"] = policy_version_lag(batch, global_sum=global_sum, device=exp.mask.device)
    row.update(train_metrics)
    largest = {**timings, "timing/rollout_step_s": sum(timings.values())}
    largest.update({k: row[k] for k in ("perf/device_peak_memory_gib",) if k in row})
    row.update(largest_over_every_rank(largest, exp.mask.device))
    row["perf/generated_tokens_per_s"] = row["rollout/generated_tokens"] / max(row["timing/generate_s"], 1e-9)
    return row


def largest_over_every_rank(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value's largest over every rank (a collective): the slowest rank's seconds (what the run waits for) and the
    largest device peak. Every rank, not the data-parallel group: with C > 1 a context-parallel group's ranks differ in
    their time and memory (their shares of every forward; rank 0 alone generates)."""
    stacked = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    largest = distributed.global_max(stacked, group=distributed.EVERY_RANK)
    return dict(zip(values, largest.tolist()))


# The statistics each rank adds as its micro-batches' shares of their mini-batch's value (`actor_loss_shares`, the value
# loss of `PPOModule.critic_backward`): summed over micro-batches and ranks, each is the whole mini-batch's.
SUMMED_OVER_RANKS = (
    "actor/policy_loss",
    "actor/clip_fraction",
    "actor/approx_kl",
    "actor/entropy",
    "critic/value_loss",
)


@torch.no_grad()
def actor_loss_shares(
    pg_tok: Tensor,
    clipped: Tensor,
    logp: Tensor,
    old_logp: Tensor,
    entropy: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    **denominators,
) -> dict[str, float]:
    """One micro-batch's shares of the actor's statistics over its global mini-batch ([B, T] each), weighted as the loss
    aggregation (`algo.aggregate_loss` with the mini-batch's `denominators`) weighs the tokens the loss keeps: summed
    over the mini-batch's micro-batches on every rank they are the mini-batch's, whatever the packing, micro-batch
    size or number of ranks. `actor/policy_loss` is the policy term of the loss as optimised; the clip fraction,
    approximate KL and entropy are means with the loss's weights, normalised: over tokens, or over samples (each its
    tokens' mean) with seq-mean-token-mean."""
    mean_mode = "seq-mean-token-mean" if loss_agg_mode == "seq-mean-token-mean" else "token-mean"

    def share(x: Tensor, mode: str) -> Tensor:
        return algo.aggregate_loss(x, loss_mask, mode, **denominators)

    shares = torch.stack(
        [
            share(pg_tok, loss_agg_mode),
            share(clipped.float(), mean_mode),
            share(0.5 * (logp - old_logp) ** 2, mean_mode),
            share(entropy.detach(), mean_mode),
        ]
    )
    return dict(zip(SUMMED_OVER_RANKS[:4], shares.tolist()))


def update_metrics(
    per_update: MeanOver,
    padded_positions: float,
    real_tokens: float,
    micro_batches: int | None = None,
    *,
    device,
    global_sum: Reduce = _identity,
    prefix_tokens_saved: float = 0.0,
) -> dict[str, float]:
    """The updates' means over the global batch: the statistics of `SUMMED_OVER_RANKS` summed over ranks (each rank's
    shares of every update's value), the gradient norms every rank's own (the same on every rank);
    `perf/padding_fraction` is the share of the training forwards' positions that are padding. `prefix_tokens_saved`:
    the real tokens the shared-prefix layout did not compute (each group's prompt once): `perf/trained_tokens` counts
    the samples' real tokens in every layout, the positions only what was laid out. Given this rank's
    `micro_batches`, also the real tokens and positions per micro-batch of all ranks."""
    summed = [k for k in SUMMED_OVER_RANKS if k in per_update.sums]
    counts = [float(padded_positions), float(real_tokens), float(prefix_tokens_saved)]
    counts += [] if micro_batches is None else [float(micro_batches)]
    totals = global_sum(
        torch.tensor([per_update.sums[k] for k in summed] + counts, dtype=torch.float64, device=device)
    ).tolist()
    per_update.sums.update(zip(summed, totals))
    positions, real, saved = totals[len(summed) : len(summed) + 3]
    metrics = {
        **per_update.means(),
        "perf/padding_fraction": 1 - (real - saved) / max(positions, 1.0),
        "perf/prefix_tokens_saved": saved,  # real tokens not computed: shared prompts, over ranks and PPO epochs
        "perf/trained_tokens": real,  # real tokens through the training forwards, over ranks and PPO epochs
        "perf/trained_positions": positions,  # positions they laid out (real tokens and padding)
    }
    if micro_batches is not None:
        all_micro_batches = totals[-1]  # of all ranks
        metrics["perf/real_tokens_per_micro_batch"] = real / max(all_micro_batches, 1.0)
        metrics["perf/padded_tokens_per_micro_batch"] = positions / max(all_micro_batches, 1.0)
    return metrics
