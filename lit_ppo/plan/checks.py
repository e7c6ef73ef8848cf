"""The run-time proofs of the plan: each reads the counts the plan states and, after the run did the thing, raises in
one line where what ran differs (the step accounting, the samples' use, the micro-batches, the rank split, the
policy versions)."""

from __future__ import annotations

from lit_ppo.errors import StalenessError, StepAccountingError
from lit_ppo.plan.step import StepPlan


def check_step_accounting(plan: StepPlan, rollout_step: int, actor_steps: int, critic_steps: int) -> None:
    """The runtime proof of the plan: after each rollout step's updates, the actor and the critic took exactly the
    optimizer steps the plan states (the critic none without one)."""
    counts = plan.counts
    expected = counts.optimizer_steps_per_rollout_step
    expected_critic = expected if plan.models.critic_enabled else 0
    if actor_steps != expected or critic_steps != expected_critic:
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: the actor took {actor_steps} and the critic {critic_steps} optimizer steps, "
            f"but the plan says {expected} each (ppo_epochs={counts.ppo_epochs} x {counts.mini_batches_per_ppo_epoch} "
            "mini-batches); the update loop is not doing what the configuration says"
        )


def check_sample_use(plan: StepPlan, rollout_step: int, use_counts: list[list[int]]) -> None:
    """The runtime proof of the global mini-batches: summed over the ranks, every sample of the rollout step's global
    batch was trained exactly once in each PPO epoch (`use_counts`: [ppo_epochs][samples]), so the ranks' shares of
    each mini-batch neither overlap nor leave a sample out, and the update is one process's."""
    counts = plan.counts
    samples = counts.samples_per_rollout_step
    wrong = [(e, i, n) for e, epoch in enumerate(use_counts) for i, n in enumerate(epoch) if n != 1]
    if len(use_counts) != counts.ppo_epochs or any(len(epoch) != samples for epoch in use_counts) or wrong:
        found = (
            f"sample {wrong[0][1]} trained {wrong[0][2]} times in PPO epoch {wrong[0][0] + 1}"
            if wrong
            else f"{len(use_counts)} PPO epochs of {[len(epoch) for epoch in use_counts]} samples"
        )
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: over the {counts.data_parallel_size} rank(s), {found}, but the plan says "
            f"each of {samples} samples once in each of {counts.ppo_epochs} PPO epochs; the ranks' shares of the "
            "mini-batches are not doing what the plan states"
        )


def check_micro_batches(plan: StepPlan, rollout_step: int, micro_batches: list[tuple[int, int]]) -> None:
    """The runtime proof of one mini-batch's micro-batches on this rank, given as (samples, tokens) each (tokens: real
    ones when packed, laid-out positions when padded): with a fixed micro-batch size, the gradient accumulation steps
    the plan states, micro_train_batch_size samples each; with a token budget, each within it (a longer sample
    alone)."""
    layout = plan.layout
    budget = layout.micro_train_max_tokens
    if budget is None:
        sizes = [samples for samples, _ in micro_batches]
        if len(sizes) != layout.grad_accumulation_steps or any(n != layout.micro_train_batch_size for n in sizes):
            raise StepAccountingError(
                f"rollout step {rollout_step + 1}: a mini-batch ran as micro-batches of {sizes} samples, but the plan says "
                f"{layout.grad_accumulation_steps} of {layout.micro_train_batch_size} (gradient accumulation); the "
                "micro-batch split is not doing what the configuration says"
            )
        return
    over = [(n, tokens) for n, tokens in micro_batches if tokens > budget and n > 1]
    if over:
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: a micro-batch of {over[0][0]} samples laid out {over[0][1]} tokens, over "
            f"ppo.micro_train_max_tokens={budget}; the micro-batch split is not doing what the configuration says"
        )


def check_layout_tokens(plan: StepPlan, rollout_step: int, laid_out: int, real_tokens: int, shared: int) -> None:
    """The runtime proof of the shared-prefix layout (`StepPlan.layout.shared_prefix`) on one micro-batch: it laid out the
    samples' real tokens less the prompt tokens their groups share (`shared`, training/shared_prefix.py:
    prefix_tokens_saved), no more and no fewer: each prompt exactly once, every response whole."""
    if laid_out != real_tokens - shared:
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: a shared-prefix micro-batch laid out {laid_out} tokens, but its samples "
            f"hold {real_tokens} real tokens of which {shared} are prompts shared in their group ({real_tokens - shared} "
            "to lay out); the layout is not what the plan states; fix: set ppo.shared_prefix=false and report this"
        )


def check_rank_balance(
    plan: StepPlan, rollout_step: int, rank_samples: list[int], rank_tokens: list[int], group_tokens: list[int]
) -> None:
    """The runtime proof of the plan's rank split (`LayoutPlan.rank_balance`), given every rank's samples and real
    tokens after the split and the prompt groups' real tokens: every rank trains samples_per_rank_per_rollout_step
    samples (its mini-batches and micro-batches, and so the collectives in them, follow from that count), and the
    heaviest rank is within the partition's bound of the lightest (the heaviest group minus the lightest)."""
    bound = max(group_tokens) - min(group_tokens) if group_tokens else 0
    expected = plan.counts.samples_per_rank_per_rollout_step
    if any(n != expected for n in rank_samples) or max(rank_tokens) - min(rank_tokens) > bound:
        raise StepAccountingError(
            f"rollout step {rollout_step + 1}: the ranks' samples split by real tokens gave {rank_samples} samples and "
            f"{rank_tokens} real tokens, but the plan says {expected} samples each, their tokens within {bound} of each "
            "other; the rank split is not doing what the plan states"
        )


def check_policy_versions(
    plan: StepPlan,
    rollout_step: int,
    policy_versions: list[int] | None,
    rounds_in_step: list[int] | None = None,
    rounds_ahead: int | None = None,
) -> None:
    """The runtime proof of the generation schedule: every sample about to be trained in `rollout_step` was generated
    by the policy version the plan states for it (`StepPlan.generating_version` of its step and of its generation
    round, `rounds_in_step`: None, every sample of round 0; `rounds_ahead`: the rounds the step was requested ahead
    with, None: the plan's), never by whatever was newest."""
    if policy_versions is None:  # batches that no engine produced (benchmarks with fixed responses)
        return
    rounds = rounds_in_step if rounds_in_step is not None else [0] * len(policy_versions)
    expected = [plan.generating_version(rollout_step, r, rounds_ahead) for r in rounds]
    wrong = [(v, e) for v, e in zip(policy_versions, expected) if v != e]
    if wrong:
        mode = "disaggregated" if plan.workers else "colocated"
        versions, planned = sorted({v for v, _ in wrong}), sorted({e for _, e in wrong})
        raise StalenessError(
            f"rollout step {rollout_step + 1}: {len(wrong)} of {len(policy_versions)} "
            f"samples were generated by policy version(s) {versions} (lag {[rollout_step - v for v in versions]}), but "
            f"the plan says version {planned[0] if len(planned) == 1 else planned} (rollout.max_staleness="
            f"{plan.max_staleness}, mode={mode}); the rollout schedule is not what the plan states"
        )


def check_carried_tokens(
    plan: StepPlan, rollout_step: int, version_spans: list[list[list[int]]] | None, response_lengths: list[int]
) -> None:
    """The runtime proof of partial rollouts' carry bound (`StepPlan.partial`): every response token about to be
    trained in `rollout_step` was generated by a policy version from s - max_age_steps to s, its spans of (first
    token, version) in token order from the response's first token."""
    bound = plan.partial.oldest_token_age
    if version_spans is None or len(version_spans) != len(response_lengths):
        raise StalenessError(
            f"rollout step {rollout_step + 1}: partial rollouts are on but the batch holds no policy version spans for "
            "its samples; the rollout step is not what the plan states"
        )
    for spans, length in zip(version_spans, response_lengths):
        starts, versions = [s for s, _ in spans], [v for _, v in spans]
        ordered = starts == sorted(set(starts)) and (not starts or (starts[0] == 0 and starts[-1] < length))
        if (length and not ordered) or any(not rollout_step - bound <= v <= rollout_step for v in versions):
            raise StalenessError(
                f"rollout step {rollout_step + 1}: a sample's tokens were generated by policy versions {versions} "
                f"(spans {spans}, {length} tokens), but the plan says versions {max(0, rollout_step - bound)} to "
                f"{rollout_step} (rollout.partial.max_age_steps={plan.partial.max_age_steps}"
                + (f" + rollout.max_staleness={plan.partial.worker_lag}" if plan.partial.worker_lag else "")
                + "); the carried samples are not what the plan states"
            )


def check_batch_versions(plan: StepPlan, batch) -> None:
    """The runtime proof of which policy generated a rollout batch (a RolloutBatch, not imported here): each sample of
    the version the schedule states (`check_policy_versions`), or with partial rollouts each token of a version within
    the carry bound (`check_carried_tokens`)."""
    if plan.partial is not None:
        check_carried_tokens(plan, batch.rollout_step, batch.version_spans, [len(r) for r in batch.response_ids])
    else:
        check_policy_versions(plan, batch.rollout_step, batch.policy_versions, batch.rounds_in_step, batch.rounds_ahead)
