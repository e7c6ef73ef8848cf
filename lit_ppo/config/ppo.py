"""The `ppo` section: the batch shape, the estimators, the loss and the optimizer (`PPOConfig`, with its nested
`ppo.rollout_correction` and `ppo.dynamic_sampling`), and their checks (`validate_ppo`; a nested section's own beside its dataclass)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from lit_ppo.algorithms import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    KL_ESTIMATORS,
    KL_IN_REWARD_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
)
from lit_ppo.config.distill import DistillConfig, check_ppo_for_distill
from lit_ppo.config.parse import positive
from lit_ppo.config_fields import above, at_least, within
from lit_ppo.errors import ConfigError

OLD_LOGPROBS = ("auto", "recompute", "rollout")  # ppo.old_logprobs


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """`ppo.rollout_correction`: weights on the policy loss for the mismatch between vLLM's sampling log-probs and
    the trainer's old log-probs (docs/algorithms.md)."""

    mode: str | None = None
    """none, tis (weight min(rho, tis_cap)) or mis (drop where rho leaves [mis_low, mis_high], else weight rho); null:
    tis where the samples are of an older policy (rollout.mode=disaggregated with max_staleness > 0), none elsewhere
    (`RunConfig` resolves it; a PPOConfig used alone treats null as none)."""

    def active(self) -> bool:
        """Whether the loss is weighted (a mode other than none; null counts as none until resolved)."""
        return self.mode not in (None, "none")

    def resolved(self, staleness_steps: int) -> RolloutCorrectionConfig:
        """mode=null made explicit for a run whose samples are up to `staleness_steps` rollout steps old."""
        if self.mode is not None:
            return self
        return dataclasses.replace(self, mode="tis" if staleness_steps > 0 else "none")

    level: str = "token"
    """token: rho per token; sequence: the geometric mean of the sequence's token ratios, for all its tokens."""
    tis_cap: float = 2.0
    """TIS: the largest weight."""
    mis_low: float = 0.5
    """MIS: tokens (sequences) with rho below this are dropped from the loss."""
    mis_high: float = 2.0
    """MIS: tokens (sequences) with rho above this are dropped from the loss."""


def validate_rollout_correction(rc: RolloutCorrectionConfig) -> None:
    """`ppo.rollout_correction`'s own settings (its mode against ppo.old_logprobs: `check_old_logprobs`)."""
    if (rc.mode is not None and rc.mode not in ROLLOUT_CORRECTION_MODES) or rc.level not in ROLLOUT_CORRECTION_LEVELS:
        raise ConfigError(
            f"ppo.rollout_correction.mode={rc.mode!r}, level={rc.level!r}; fix: mode one of "
            f"{', '.join(ROLLOUT_CORRECTION_MODES)} (or null: by rollout.mode), level one of {', '.join(ROLLOUT_CORRECTION_LEVELS)}"
        )
    if rc.mode == "tis" and rc.tis_cap <= 0:
        raise ConfigError(f"ppo.rollout_correction.tis_cap={rc.tis_cap} must be positive; fix: e.g. 2.0")
    if rc.mode == "mis" and not 0 <= rc.mis_low < 1 < rc.mis_high:
        raise ConfigError(
            f"ppo.rollout_correction.mis_low={rc.mis_low}, mis_high={rc.mis_high}: need 0 <= low < 1 < high; "
            "fix: e.g. mis_low=0.5 mis_high=2.0"
        )


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """`ppo.dynamic_sampling` (DAPO): train only on prompt groups whose rewards differ, generating more rounds of
    prompts until `rollout_batch_size` of them are collected."""

    enabled: bool = False
    max_generation_rounds: int = 3
    """Generation rounds per rollout step at most (the first one included)."""
    prompts_per_round: int | None = None
    """Prompts each round draws from the data (global); null: rollout_batch_size."""
    on_shortfall: Literal["fill", "stop"] = "fill"
    """After max_generation_rounds with fewer informative groups: fill (complete the batch with dropped groups, in
    the order drawn, so the optimizer steps stay as planned) or stop (save a checkpoint and end with a message)."""
    expected_informative_fraction: float = field(default=0.5, metadata=within(0, 1, low_open=True))
    """The share of prompt groups expected to have differing rewards: the plan's expected generation rounds rest on it,
    and under rollout.mode=disaggregated each rollout step is requested ahead with the rounds it then needs
    (ceil(rollout_batch_size / (prompts_per_round x this)), at most max_generation_rounds); more are generated after
    the step's rewards (refill), fewer are given back to the prompt stream."""


def validate_dynamic_sampling(ds: DynamicSamplingConfig) -> None:
    """`ppo.dynamic_sampling`'s own settings, where it is on (its samples per prompt: `validate_ppo`)."""
    positive("ppo.dynamic_sampling", max_generation_rounds=ds.max_generation_rounds)
    if ds.prompts_per_round is not None:
        positive("ppo.dynamic_sampling", prompts_per_round=ds.prompts_per_round)
    if ds.on_shortfall not in ("fill", "stop"):
        raise ConfigError(f"ppo.dynamic_sampling.on_shortfall={ds.on_shortfall!r}; fix: use 'fill' or 'stop'")


@dataclass(frozen=True)
class PPOConfig:
    """The `ppo` config group. Batch sizes carry their unit in the docstring."""

    rollout_batch_size: int = 32
    """Prompts per rollout step (global, over all data-parallel ranks)."""
    n_samples_per_prompt: int = 4
    """Responses generated per prompt."""
    ppo_epochs: int = 1
    """Passes over one rollout batch; each pass reshuffles the mini-batches."""
    train_batch_size: int = 64
    """Samples (responses) per optimizer step (global)."""
    micro_train_batch_size: int = 32
    """Samples per forward/backward on one device."""
    micro_train_max_tokens: int | None = None
    """Padded tokens (prompt + response columns x rows) per forward/backward on one device: each mini-batch is sorted
    by length and cut into micro-batches under this budget (verl's dynamic batch size, OpenRLHF's max_tokens_per_gpu),
    so short samples are not padded to the longest of a fixed-size micro-batch; micro_train_batch_size is then unused
    for splitting. Loss denominators and optimizer steps are unchanged. null: fixed micro_train_batch_size."""
    packing: bool | None = None
    """Padding-free micro-batches: whole samples (prompt + response) laid end to end, position ids restarting at each,
    attention kept within each sample by the model library (transformers' block-diagonal mask from packed position ids,
    flash-attention's varlen kernel), the LM head only where a response token is predicted; micro_train_max_tokens then
    counts real tokens. null: on wherever the model's attention supports packed position ids (the pre-flight reads
    config.json; the plan says which); true: refused where it does not; false: padded rows."""
    shared_prefix: bool | None = None
    """Packed micro-batches with each prompt once: a prompt group's samples in one micro-batch share their prompt's
    tokens (a multi-turn episode's first prompt), each response attending to the prompt and to itself only (a 4-D
    mask; flex attention: a block mask), its position ids going on from the prompt's; log-probs, values and gradients
    are the flat packed layout's (lit_ppo/training/shared_prefix.py). Under data parallelism a group's samples train on
    one rank. null: on where that is exact (packing on, n_samples_per_prompt >= 2, sdpa, eager or flex_attention, no
    sliding window); true: refused where it is not; false: every sample's prompt laid out."""
    old_logprobs: str = "auto"
    """Where the PPO ratio's old log-probs come from. recompute: an experience forward of the actor before the updates;
    auto: skip that forward when the update is exactly on-policy (ppo_epochs=1, one mini-batch per rollout step, no KL
    in the reward, rollout_correction none), where old log-probs equal the training forward's own (ratio 1, the same
    gradient), else recompute; rollout: vLLM's sampling log-probs, never a forward (the ratio is then against the
    sampler, which the clip bounds; rollout_correction must be none)."""
    advantage_estimator: str = "gae"
    """One of gae, reinforce_pp, reinforce_pp_baseline, grpo, dr_grpo, rloo, on_policy_distill (`ppo.distill`)."""
    gamma: float = field(default=1.0, metadata=within(0, 1))
    """Discount per token."""
    lam: float = field(default=0.95, metadata=within(0, 1))
    """GAE lambda."""
    normalize_advantages: bool = True
    """Whiten GAE advantages over the whole rollout batch (global statistics)."""
    clip_ratio_low: float = 0.2
    """Policy ratio may fall to 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Policy ratio may rise to 1 + clip_ratio_high (DAPO clip-higher when > low)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative advantages; null disables."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the actor loss."""
    value_clip: float | None = field(default=0.2, metadata=above(0))
    """Clip range of the new value around the old one; null disables."""
    value_loss_coef: float = field(default=0.5, metadata=at_least(0))
    """Weight of the value loss (the critic has its own optimizer, so this scales its LR)."""
    kl_coef: float = 0.01
    """KL coefficient; 0 removes the reference model."""
    kl_estimator: str = "k1"
    """k1, k2 or k3."""
    kl_mode: str = "reward"
    """reward: subtract kl_coef * KL from each token's reward; loss: add kl_coef * KL to the actor loss."""
    adaptive_kl_target: float | None = field(default=None, metadata=above(0))
    """Target KL per sequence for the adaptive controller; null keeps kl_coef fixed."""
    adaptive_kl_horizon: int = field(default=10000, metadata=at_least(1))
    """Horizon (samples) of the adaptive KL controller."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    actor_lr: float = 2e-4
    """Peak learning rate of the actor."""
    critic_lr: float = 5e-4
    """Peak learning rate of the critic."""
    lr_warmup_ratio: float = 0.0
    """Share of the total optimizer steps spent warming up the LR linearly."""
    lr_schedule: str = "constant"
    """constant or cosine (after warm-up), stepped once per optimizer step."""
    weight_decay: float = field(default=0.0, metadata=at_least(0))
    """AdamW weight decay."""
    max_grad_norm: float = field(default=1.0, metadata=above(0))
    """Gradient clipping by total norm, per optimizer step."""
    shuffle_seed: int = 0
    """Seed of the mini-batch order (reshuffled every PPO epoch)."""
    policy_loss: str = "ppo"
    """ppo (clipped surrogate), gspo (one clipped ratio per sequence) or cispo (clipped IS weight on REINFORCE)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        check_ppo_for_distill(self)  # first: its one-line reasons name the distillation, not a generic rule
        validate_ppo(self)


def validate_ppo(ppo: PPOConfig) -> None:
    """Checks that do not need the dataset size."""
    positive(
        "ppo",
        rollout_batch_size=ppo.rollout_batch_size,
        n_samples_per_prompt=ppo.n_samples_per_prompt,
        ppo_epochs=ppo.ppo_epochs,
        train_batch_size=ppo.train_batch_size,
        micro_train_batch_size=ppo.micro_train_batch_size,
    )
    check_estimators(ppo)
    check_policy_loss(ppo)
    validate_rollout_correction(ppo.rollout_correction)
    check_old_logprobs(ppo)
    if ppo.micro_train_max_tokens is not None:
        positive("ppo", micro_train_max_tokens=ppo.micro_train_max_tokens)
    ds = ppo.dynamic_sampling
    if ds.enabled:
        if ppo.n_samples_per_prompt < 2:
            raise ConfigError(
                f"ppo.dynamic_sampling.enabled=true drops groups whose rewards are all equal, but "
                f"ppo.n_samples_per_prompt={ppo.n_samples_per_prompt}; fix: set it to 2 or more"
            )
        validate_dynamic_sampling(ds)
    check_optimizer(ppo)


def check_estimators(ppo: PPOConfig) -> None:
    """The advantage estimator and the KL: known, and the pairs that do not go together refused."""
    if ppo.advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(
            f"ppo.advantage_estimator={ppo.advantage_estimator!r} is unknown; fix: use one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if ppo.advantage_estimator in GROUP_ESTIMATORS and ppo.n_samples_per_prompt < 2:
        raise ConfigError(
            f"ppo.advantage_estimator={ppo.advantage_estimator} compares samples of one prompt but "
            f"ppo.n_samples_per_prompt={ppo.n_samples_per_prompt}; fix: set ppo.n_samples_per_prompt to 2 or more"
        )
    if ppo.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(
            f"ppo.kl_estimator={ppo.kl_estimator!r} is unknown; fix: use one of {', '.join(KL_ESTIMATORS)}"
        )
    if ppo.kl_mode not in ("reward", "loss"):
        raise ConfigError(f"ppo.kl_mode={ppo.kl_mode!r} is unknown; fix: use 'reward' or 'loss'")
    if ppo.kl_coef < 0:
        raise ConfigError(f"ppo.kl_coef={ppo.kl_coef} is negative; fix: use 0 (no KL) or a positive value")
    if ppo.kl_mode == "reward" and ppo.kl_coef > 0 and ppo.advantage_estimator not in KL_IN_REWARD_ESTIMATORS:
        raise ConfigError(
            f"ppo.advantage_estimator={ppo.advantage_estimator} with ppo.kl_mode=reward: a KL penalty in the reward would "
            "give groups of equal rewards non-zero advantages; fix: set ppo.kl_mode=loss (with ppo.kl_estimator=k3, as "
            "GRPO does) or ppo.kl_coef=0"
        )


def check_policy_loss(ppo: PPOConfig) -> None:
    """The loss aggregation, the policy loss and its clip ranges."""
    if ppo.loss_agg_mode not in LOSS_AGG_MODES:
        raise ConfigError(
            f"ppo.loss_agg_mode={ppo.loss_agg_mode!r} is unknown; fix: use one of {', '.join(LOSS_AGG_MODES)}"
        )
    if ppo.policy_loss not in POLICY_LOSSES:
        raise ConfigError(f"ppo.policy_loss={ppo.policy_loss!r} is unknown; fix: use one of {', '.join(POLICY_LOSSES)}")
    # CISPO may leave the weight's low side open (low = 1: weight >= 0), as MiniMax-M1 does.
    low_ok = 0 < ppo.clip_ratio_low <= 1 if ppo.policy_loss == "cispo" else 0 < ppo.clip_ratio_low < 1
    if not low_ok or ppo.clip_ratio_high <= 0:
        raise ConfigError(
            f"ppo.clip_ratio_low={ppo.clip_ratio_low}, ppo.clip_ratio_high={ppo.clip_ratio_high}: need 0 < low < 1 "
            "(<= 1 for cispo) and high > 0; fix: e.g. clip_ratio_low=0.2 clip_ratio_high=0.28"
        )
    if ppo.dual_clip is not None and ppo.dual_clip <= 1:
        raise ConfigError(f"ppo.dual_clip={ppo.dual_clip} must be > 1 (e.g. 3.0); fix: set it above 1 or to null")
    if ppo.dual_clip is not None and ppo.policy_loss != "ppo":
        raise ConfigError(
            f"ppo.dual_clip={ppo.dual_clip} bounds the clipped surrogate of policy_loss=ppo, not "
            f"ppo.policy_loss={ppo.policy_loss}; fix: set ppo.dual_clip=null"
        )


def check_old_logprobs(ppo: PPOConfig) -> None:
    """Where the old log-probs come from, and that a rollout correction is left something to weight."""
    rc = ppo.rollout_correction
    if ppo.old_logprobs not in OLD_LOGPROBS:
        raise ConfigError(
            f"ppo.old_logprobs={ppo.old_logprobs!r} is unknown; fix: use one of {', '.join(OLD_LOGPROBS)}"
        )
    if ppo.old_logprobs == "rollout" and rc.active():
        raise ConfigError(
            f"ppo.old_logprobs=rollout takes vLLM's log-probs as the old ones, so "
            f"ppo.rollout_correction.mode={rc.mode} has no mismatch left to weight (its ratio is 1); fix: set "
            "ppo.rollout_correction.mode=none, or ppo.old_logprobs=recompute to keep the correction"
        )


def check_optimizer(ppo: PPOConfig) -> None:
    """The learning rates and their schedule."""
    if ppo.lr_schedule not in ("constant", "cosine"):
        raise ConfigError(f"ppo.lr_schedule={ppo.lr_schedule!r} is unknown; fix: use 'constant' or 'cosine'")
    if not 0 <= ppo.lr_warmup_ratio < 1:
        raise ConfigError(f"ppo.lr_warmup_ratio={ppo.lr_warmup_ratio} must be in [0, 1); fix: e.g. 0.03")
    if ppo.actor_lr <= 0 or ppo.critic_lr <= 0:
        raise ConfigError(
            f"ppo.actor_lr={ppo.actor_lr}, ppo.critic_lr={ppo.critic_lr} must be positive; fix: e.g. 1e-6"
        )
