"""What the losses of one micro-batch read (`LossInputs`, built once per micro-batch from the rollout step's
experience) and the actor's and the critic's losses on it, composed of lit_ppo.algorithms' pure tensor functions.

Shapes: B samples of the micro-batch, T its longest response.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lit_ppo import algorithms as algo
from lit_ppo.config import PPOConfig
from lit_ppo.training.batching import MicroBatch
from lit_ppo.training.experience import Experience
from lit_ppo.training.metrics import actor_loss_shares
from lit_ppo.training.numerics import old_logprobs_used


@dataclass(frozen=True)
class LossInputs:
    """The tensors the actor's and the critic's losses read of one micro-batch, besides the forwards' outputs. A field
    the run does not have is None (no critic: no `old_values`; the KL in the reward or no reference: no `ref_logp`),
    so that no loss can mistake zeros for values."""

    response_mask: Tensor  # [B, T] 1.0 on the policy's response tokens (the micro-batch's `response_mask`)
    loss_mask: Tensor  # [B, T] the tokens the policy loss keeps: the response mask unless MIS drops some
    advantages: Tensor  # [B, T]
    returns: Tensor  # [B, T] the value loss's targets
    # [B, T] the actor's log-probs before the rollout step's updates; None exactly on-policy without an experience
    # forward (StepPlan.old_logprobs.source "training forward"): the training forward's own, detached, are the old ones
    old_logp: Tensor | None
    rc_weights: Tensor | None  # [B, T] the rollout correction's weights on the policy loss (the mask when off)
    ref_logp: Tensor | None  # [B, T] the reference's log-probs when the KL is in the loss (ppo.kl_mode=loss)
    old_values: Tensor | None  # [B, T] the critic's values before the rollout step's updates
    num_tokens: Tensor  # [] the global mini-batch's response tokens (the value loss's denominator)
    num_seqs: Tensor  # [] the global mini-batch's samples
    num_policy_tokens: Tensor  # [] the global mini-batch's tokens the policy loss keeps (the actor's token denominator)

    @classmethod
    def of(
        cls,
        exp: Experience,
        idx: list[int],
        mb: MicroBatch,
        denominators: tuple[Tensor, Tensor, Tensor],
        ppo: PPOConfig,
    ) -> LossInputs:
        """The micro-batch `mb` of the samples `idx` of `exp` (the global experience), in the global mini-batch whose
        `denominators` are (response tokens, samples, policy-loss tokens): `experience.loss_denominators`."""
        rows = exp.rows(idx, mb.response_ids.shape[1])
        num_tokens, num_seqs, num_policy_tokens = denominators
        return cls(
            response_mask=mb.response_mask,
            loss_mask=rows.loss_mask,
            advantages=rows.advantages,
            returns=rows.returns,
            old_logp=rows.old_logp,
            rc_weights=rows.rc_weights,
            ref_logp=rows.ref_logp if ppo.kl_mode == "loss" else None,
            old_values=rows.values,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_policy_tokens=num_policy_tokens,
        )


def actor_loss(
    logp: Tensor, entropy: Tensor, inputs: LossInputs, ppo: PPOConfig, *, kl_coef: float, max_len: int
) -> tuple[Tensor, dict[str, float]]:
    """The actor's loss on one micro-batch from its forward's log-probs and entropies ([B, T] each): this micro-batch's
    share of the global mini-batch's loss (`algo.actor_token_loss`, aggregated with the mini-batch's denominators, so
    that the shares add up to the mini-batch's over micro-batches and ranks) and its shares of the actor's statistics
    (`actor_loss_shares`)."""
    old_logp = old_logprobs_used(logp, inputs)
    loss_tok, pg_tok, clipped = algo.actor_token_loss(
        logp,
        old_logp,
        inputs.advantages,
        inputs.response_mask,
        entropy,
        policy_loss=ppo.policy_loss,
        clip_ratio_low=ppo.clip_ratio_low,
        clip_ratio_high=ppo.clip_ratio_high,
        dual_clip=ppo.dual_clip,
        rc_weights=inputs.rc_weights,
        entropy_coef=ppo.entropy_coef,
        ref_logp=inputs.ref_logp,
        kl_estimator=ppo.kl_estimator,
        kl_coef=kl_coef,
    )
    denominators = dict(num_tokens=inputs.num_policy_tokens, num_seqs=inputs.num_seqs, max_len=max_len)
    loss = algo.aggregate_loss(loss_tok, inputs.loss_mask, ppo.loss_agg_mode, **denominators)
    shares = actor_loss_shares(
        pg_tok, clipped, logp, old_logp, entropy, inputs.loss_mask, ppo.loss_agg_mode, **denominators
    )
    return loss, shares


def critic_loss(values: Tensor, inputs: LossInputs, ppo: PPOConfig) -> Tensor:
    """The critic's loss on one micro-batch from its values [B, T]: this micro-batch's share of the global mini-batch's
    token-mean value loss (clipped around the old values by ppo.value_clip), before ppo.value_loss_coef."""
    loss_tok, _ = algo.value_loss(values, inputs.old_values, inputs.returns, value_clip=ppo.value_clip)
    return algo.aggregate_loss(loss_tok, inputs.response_mask, "token-mean", num_tokens=inputs.num_tokens)
