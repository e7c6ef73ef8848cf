"""The evaluation of the data module's policy on its held-out prompts (`evaluate`): greedy accuracy (mean reward at
temperature 0) and pass@k, each rank on its contiguous share of the prompts, the sums all-reduced, through the data
module's one generation path (`RolloutDataModule.generate`) and its scoring (`rewards_of`). `dm`: the data module
(lit_ppo/rollout/datamodule.py, which imports this module)."""

from __future__ import annotations

from typing import Callable

import torch

from lit_ppo.distributed import global_sum
from lit_ppo.preemption import interruptibly, stop_point


def solved(rewards: list[float], sample_metrics: dict[str, list[float]], solved_threshold: float) -> list[bool]:
    """Per sample: did it solve its prompt? The reward's own `correct` metric where it returns one (a well-formatted
    wrong answer can earn reward), else a reward of at least `reward.solved_threshold`."""
    correct = sample_metrics.get("correct")
    if correct is not None and len(correct) == len(rewards):
        return [c > 0 for c in correct]
    return [r >= solved_threshold for r in rewards]


def local_pass(dm, prompts: list, positions: list[int], k: int, cut: Callable) -> tuple[list, list, list] | None:
    """This rank's greedy samples, their rewards and per prompt whether one of k samples solved it (None: a
    preemption signal cut the scoring)."""
    greedy, greedy_rewards, solved_prompts = [], [], []
    if not prompts:  # a rank can have none when there are fewer eval prompts than ranks
        if dm.plan.workers and dm.topology.distributed:  # rank 0 drives the workers: each rank's generate
            for _ in range(2 if k > 1 else 1):  # is a collective (rollout/workers/ranks.py), so it asks too
                dm.generate([], [], 1, temperature=0.0, top_p=1.0, purpose=None, where="evaluation")
        return greedy, greedy_rewards, solved_prompts
    # Both passes generated before any reward is scored: with rollout workers and several ranks each generate
    # is a collective, which a rank whose scoring a signal cut would otherwise not meet.
    greedy = dm.generate(prompts, positions, 1, temperature=0.0, top_p=1.0, purpose=None, where="evaluation")
    if k > 1:
        temperature = dm.rollout.eval_temperature
        sampled = dm.generate(
            prompts, positions, k, temperature=temperature, top_p=1.0, purpose="eval", where="evaluation"
        )
    scored = cut(lambda: dm.rewards_of(prompts, greedy))
    if scored is None:
        return None
    greedy_rewards = scored[0]
    if k > 1:
        scored = cut(lambda: dm.rewards_of(prompts, sampled))
        if scored is None:
            return None
        sample_solved = solved(*scored[:2], dm.scorer.solved_threshold)
        solved_prompts = [any(sample_solved[i * k : (i + 1) * k]) for i in range(len(prompts))]
    return greedy, greedy_rewards, solved_prompts


def evaluate(dm, k: int | None = None) -> dict:
    """Greedy accuracy (mean reward at temperature 0) and pass@k on the held-out prompts: the share of
    prompts with a solved sample among k (`solved`: the reward's `correct` metric, else a reward of at least
    `reward.solved_threshold`).

    Each rank evaluates its contiguous share of the prompts and the sums are all-reduced, so every
    rank returns the same numbers; `eval/samples` are the first greedy samples of rank 0's share."""
    if not dm.eval_prompts:
        return {}
    positions = list(dm.rank_positions(len(dm.eval_prompts)))
    prompts = dm.eval_prompts.prompts[positions[0] : positions[-1] + 1] if positions else []
    k = k or dm.rollout.eval_samples_per_prompt
    episodic = dm.make_environment is not None
    # A preemption signal drops the pass (lit_ppo.preemption): the whole of it where generation can be cut (as in
    # `generate_round`), else its reward calls; the stop point, before the all-reduce, stops every rank together.
    whole = dm.source.interruptible
    cut = (lambda fn: fn()) if whole else interruptibly
    run = lambda: local_pass(dm, prompts, positions, k, cut)  # noqa: E731
    evaluated = interruptibly(run) if whole else run()
    stop_point(dm.device)  # a signal during the evaluation stops here (`evaluated` is then None)
    greedy, greedy_rewards, solved_prompts = evaluated
    sums = [sum(greedy_rewards), sum(len(g.token_ids) for g in greedy), sum(solved_prompts), len(prompts)]
    if episodic:
        sums += [sum(g.tool_calls > 0 for g in greedy), sum(g.turns for g in greedy)]
    totals = global_sum(torch.tensor(sums, dtype=torch.float64, device=dm.device)).tolist()
    reward_sum, length_sum, solved_sum, count = totals[:4]
    result = {"eval/reward": reward_sum / count, "eval/response_length": length_sum / count}
    if k > 1:
        result[f"eval/pass@{k}"] = solved_sum / count
    if episodic:  # of the greedy episodes
        result["eval/tool_call_rate"] = totals[4] / count
        result["eval/turns_mean"] = totals[5] / count
    result["eval/samples"] = [
        {"prompt": p.text, "response": g.text, "reward": r}
        for p, g, r in list(zip(prompts, greedy, greedy_rewards))[:8]
    ]
    return result
