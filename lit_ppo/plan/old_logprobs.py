"""The old log-probs: where the PPO ratio's old log-probs come from in this run (ppo.old_logprobs resolved)."""

from __future__ import annotations

from dataclasses import dataclass

from lit_ppo.config import PPOConfig
from lit_ppo.plan.table import Row

OLD_LOGPROBS_SOURCES = {
    "experience forward": "a no-grad forward of the actor before the updates",
    "training forward": "on-policy: the training forward's own log-probs, detached (ratio 1; no experience forward)",
    "vLLM": "the sampler's log-probs (no experience forward)",
}


@dataclass(frozen=True)
class OldLogprobsPlan:
    """Where the PPO ratio's old log-probs come from (`old_logprobs_plan`)."""

    source: str = "experience forward"  # a key of OLD_LOGPROBS_SOURCES

    def rows(self) -> list[Row]:
        return [("old log-probs", self.source, OLD_LOGPROBS_SOURCES[self.source])]


def old_logprobs_plan(ppo: PPOConfig, mini_batches_per_ppo_epoch: int) -> tuple[str, str]:
    """`ppo.old_logprobs` resolved: the source of the old log-probs (a key of OLD_LOGPROBS_SOURCES) and, when auto
    keeps the experience forward of an on-policy update, a note saying why.

    The update is exactly on-policy when the rollout step takes one optimizer step (one PPO epoch, one mini-batch):
    every training forward then runs on the weights that generated the batch, so its detached log-probs are the old
    ones and the experience forward would compute the same numbers again. Three other readers of the old log-probs need
    them before the update and keep the forward: a KL penalty in the reward (advantages come from it), the teacher term
    of on-policy distillation (likewise) and the rollout correction's weights."""
    if ppo.old_logprobs == "rollout":
        return "vLLM", ""
    if ppo.old_logprobs == "recompute":
        return "experience forward", ""
    on_policy = ppo.ppo_epochs == 1 and mini_batches_per_ppo_epoch == 1
    kl_in_reward = ppo.kl_coef > 0 and ppo.kl_mode == "reward"
    distill = ppo.advantage_estimator == "on_policy_distill"
    if on_policy and not kl_in_reward and not distill and not ppo.rollout_correction.active():
        return "training forward", ""
    if not on_policy:  # the usual case (several updates per rollout step): nothing to say
        return "experience forward", ""
    if distill:
        why = "the teacher term of the advantage (on_policy_distill) needs the student's before the update"
    elif kl_in_reward:
        why = "the KL penalty in the reward (ppo.kl_mode=reward) needs them before the update"
    else:
        why = f"ppo.rollout_correction.mode={ppo.rollout_correction.mode} needs them before the update"
    return (
        "experience forward",
        f"old log-probs: the update is on-policy, but the actor's experience forward runs because {why}",
    )
