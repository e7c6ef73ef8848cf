"""The step plan: every count the run will perform, computed once from the config.

Vocabulary (README "Glossary of steps"):
- rollout step: generate responses for one rollout batch of prompts, then train on them.
- optimizer step: one `optimizer.step()` of the actor (the critic takes the same number).
- data epoch: one pass over the prompt dataset.

`compute_plan` is the only place these numbers are derived. The data module, the PPO
loops, the LR schedulers, the logs and the runtime check all read the `StepPlan` it returns.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

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
from lit_ppo.precision import describe as describe_precision


from lit_ppo.errors import ConfigError  # noqa: E402,F401 - defined with every user error; importable from here too


@dataclass
class RolloutCorrectionConfig:
    """`ppo.rollout_correction`: weights on the policy loss for the mismatch between vLLM's sampling log-probs and
    the trainer's old log-probs (docs/algorithms.md)."""

    mode: str = "none"
    """none, tis (weight min(rho, tis_cap)) or mis (drop where rho leaves [mis_low, mis_high], else weight rho)."""
    level: str = "token"
    """token: rho per token; sequence: the geometric mean of the sequence's token ratios, for all its tokens."""
    tis_cap: float = 2.0
    """TIS: the largest weight."""
    mis_low: float = 0.5
    """MIS: tokens (sequences) with rho below this are dropped from the loss."""
    mis_high: float = 2.0
    """MIS: tokens (sequences) with rho above this are dropped from the loss."""


@dataclass
class DynamicSamplingConfig:
    """`ppo.dynamic_sampling` (DAPO): train only on prompt groups whose rewards differ, generating more rounds of
    prompts until `rollout_batch_size` of them are collected."""

    enabled: bool = False
    max_generation_rounds: int = 3
    """Generation rounds per rollout step at most (the first one included)."""
    prompts_per_round: int | None = None
    """Prompts each round draws from the data (global); null: rollout_batch_size."""
    on_shortfall: str = "fill"
    """After max_generation_rounds with fewer informative groups: fill (complete the batch with dropped groups, in
    the order drawn, so the optimizer steps stay as planned) or stop (save a checkpoint and end with a message)."""


@dataclass
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
    micro_train_batch_size: int = 16
    """Samples per forward/backward on one device."""
    advantage_estimator: str = "gae"
    """One of gae, reinforce_pp, reinforce_pp_baseline, grpo, dr_grpo, rloo."""
    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
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
    value_clip: float | None = 0.2
    """Clip range of the new value around the old one; null disables."""
    value_loss_coef: float = 0.5
    """Weight of the value loss (the critic has its own optimizer, so this scales its LR)."""
    kl_coef: float = 0.01
    """KL coefficient; 0 removes the reference model."""
    kl_estimator: str = "k1"
    """k1, k2 or k3."""
    kl_mode: str = "reward"
    """reward: subtract kl_coef * KL from each token's reward; loss: add kl_coef * KL to the actor loss."""
    adaptive_kl_target: float | None = None
    """Target KL per sequence for the adaptive controller; null keeps kl_coef fixed."""
    adaptive_kl_horizon: int = 10000
    """Horizon (samples) of the adaptive KL controller."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    actor_lr: float = 1e-5
    """Peak learning rate of the actor."""
    critic_lr: float = 5e-5
    """Peak learning rate of the critic."""
    lr_warmup_ratio: float = 0.0
    """Share of the total optimizer steps spent warming up the LR linearly."""
    lr_schedule: str = "constant"
    """constant or cosine (after warm-up), stepped once per optimizer step."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by total norm, per optimizer step."""
    shuffle_seed: int = 0
    """Seed of the mini-batch order (reshuffled every PPO epoch)."""
    policy_loss: str = "ppo"
    """ppo (clipped surrogate), gspo (one clipped ratio per sequence) or cispo (clipped IS weight on REINFORCE)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


@dataclass
class RunLengthConfig:
    """The `trainer` section: how long the run is. Exactly one of the two is set."""

    total_rollout_steps: int | None = None
    data_epochs: float | None = None


@dataclass
class StepPlan:
    """What the run will do, in numbers. Every loop and scheduler reads this."""

    data_parallel_size: int
    dataset_prompts: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    samples_per_rollout_step: int
    rollout_steps_per_data_epoch: int
    prompts_dropped_per_data_epoch: int
    total_rollout_steps: int
    data_epochs: float
    prompt_passes: float
    ppo_epochs: int
    train_batch_size: int
    micro_train_batch_size: int
    mini_batches_per_ppo_epoch: int
    optimizer_steps_per_rollout_step: int
    total_optimizer_steps: int
    grad_accumulation_steps: int
    samples_per_rank_per_rollout_step: int
    total_samples_generated: int
    max_response_tokens: int
    max_tokens_generated: int
    lr_scheduler_unit: str
    lr_warmup_steps: int
    lr_total_steps: int
    critic_enabled: bool
    reference_enabled: bool
    # Generation rounds: a rollout step draws 1 round of prompts, or up to max_generation_rounds with dynamic
    # sampling; the prompt order advances by rounds, generation_rounds_per_data_epoch of them per data epoch.
    dynamic_sampling: bool = False
    prompts_per_generation_round: int = 0
    max_generation_rounds: int = 1
    generation_rounds_per_data_epoch: int = 0
    dynamic_sampling_on_shortfall: str = "fill"
    precision: str = "32-true"  # resolved (lit_ppo.precision): 32-true, bf16-mixed or bf16-true
    rollout_dtype: str = "float32"  # vLLM's dtype
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # settings that run but train off what was sampled

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """A human-readable table, one line per number, with its unit."""
        rows = [
            ("data-parallel size", self.data_parallel_size, "ranks"),
            ("dataset", self.dataset_prompts, "prompts"),
            ("rollout batch", self.rollout_batch_size, "prompts / rollout step"),
            ("samples per prompt", self.n_samples_per_prompt, "responses"),
            ("samples per rollout step", self.samples_per_rollout_step, "responses"),
            ("rollout steps per data epoch", self.rollout_steps_per_data_epoch, "rollout steps"),
            ("prompts dropped per data epoch", self.prompts_dropped_per_data_epoch,
             "prompts (last partial rollout batch; reshuffled each data epoch)"),
            ("total rollout steps", self.total_rollout_steps, "rollout steps"),
            *([("dynamic sampling: prompts per round", self.prompts_per_generation_round,
                "prompts drawn per generation round (groups with equal rewards are dropped)"),
               ("dynamic sampling: rounds", self.max_generation_rounds,
                f"generation rounds / rollout step at most (then: {self.dynamic_sampling_on_shortfall})"),
               ("generation rounds per data epoch", self.generation_rounds_per_data_epoch, "rounds")]
              if self.dynamic_sampling else []),
            ("data epochs", round(self.data_epochs, 3), "rollout steps / rollout steps per data epoch"),
            ("prompt passes", round(self.prompt_passes, 3), "prompts generated for / dataset prompts"),
            ("PPO epochs", self.ppo_epochs, "passes over each rollout batch"),
            ("train batch", self.train_batch_size, "samples / optimizer step"),
            ("mini-batches per PPO epoch", self.mini_batches_per_ppo_epoch, "optimizer steps"),
            ("optimizer steps per rollout step", self.optimizer_steps_per_rollout_step,
             "actor, and the critic as many" if self.critic_enabled else "actor (no critic)"),
            ("total optimizer steps", self.total_optimizer_steps, "actor" + (" (critic the same)" if self.critic_enabled else "")),
            ("micro batch", self.micro_train_batch_size, "samples / forward-backward / rank"),
            ("gradient accumulation", self.grad_accumulation_steps, "micro-batches / optimizer step / rank"),
            ("samples generated", self.total_samples_generated, "responses"),
            ("generated tokens (upper bound)", self.max_tokens_generated, "tokens"),
            ("LR warm-up", self.lr_warmup_steps, self.lr_scheduler_unit + "s"),
            ("LR schedule length", self.lr_total_steps, self.lr_scheduler_unit + "s"),
            ("critic", "yes" if self.critic_enabled else "no", ""),
            ("reference model", "yes" if self.reference_enabled else "no", ""),
            ("precision", self.precision, describe_precision(self.precision)),
            ("vLLM dtype", self.rollout_dtype, "sampling"),
        ]
        width = max(len(r[0]) for r in rows)
        lines = ["Step plan", "-" * (width + 30)]
        lines += [f"{name:<{width}}  {value!s:>10}  {unit}" for name, value, unit in rows]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def parse_section(cls: type, values: Mapping[str, Any], section: str):
    """Build a config dataclass, refusing unknown keys with a one-line message."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(
            f"{section}: unknown key(s) {', '.join(section + '.' + k for k in unknown)}; "
            f"fix: remove them or use one of {', '.join(names)}"
        )
    types = typing.get_type_hints(cls)
    values = dict(values)
    for name, value in values.items():  # nested sections (ppo.rollout_correction, ...) are dataclasses too
        if dataclasses.is_dataclass(types[name]) and isinstance(value, Mapping):
            values[name] = parse_section(types[name], value, f"{section}.{name}")
    return cls(**values)


def _positive(section: str, **values: Any) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{section}.{key}={value!r} must be a positive integer; fix: set {section}.{key} to 1 or more")


def validate_ppo(ppo: PPOConfig) -> None:
    """Checks that do not need the dataset size."""
    _positive(
        "ppo",
        rollout_batch_size=ppo.rollout_batch_size,
        n_samples_per_prompt=ppo.n_samples_per_prompt,
        ppo_epochs=ppo.ppo_epochs,
        train_batch_size=ppo.train_batch_size,
        micro_train_batch_size=ppo.micro_train_batch_size,
    )
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
        raise ConfigError(f"ppo.kl_estimator={ppo.kl_estimator!r} is unknown; fix: use one of {', '.join(KL_ESTIMATORS)}")
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
    if ppo.loss_agg_mode not in LOSS_AGG_MODES:
        raise ConfigError(f"ppo.loss_agg_mode={ppo.loss_agg_mode!r} is unknown; fix: use one of {', '.join(LOSS_AGG_MODES)}")
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
        raise ConfigError(f"ppo.dual_clip={ppo.dual_clip} bounds the clipped surrogate of policy_loss=ppo, not "
                          f"ppo.policy_loss={ppo.policy_loss}; fix: set ppo.dual_clip=null")
    rc = ppo.rollout_correction
    if rc.mode not in ROLLOUT_CORRECTION_MODES or rc.level not in ROLLOUT_CORRECTION_LEVELS:
        raise ConfigError(f"ppo.rollout_correction.mode={rc.mode!r}, level={rc.level!r}; fix: mode one of "
                          f"{', '.join(ROLLOUT_CORRECTION_MODES)}, level one of {', '.join(ROLLOUT_CORRECTION_LEVELS)}")
    if rc.mode == "tis" and rc.tis_cap <= 0:
        raise ConfigError(f"ppo.rollout_correction.tis_cap={rc.tis_cap} must be positive; fix: e.g. 2.0")
    if rc.mode == "mis" and not 0 <= rc.mis_low < 1 < rc.mis_high:
        raise ConfigError(f"ppo.rollout_correction.mis_low={rc.mis_low}, mis_high={rc.mis_high}: need 0 <= low < 1 < high; "
                          "fix: e.g. mis_low=0.5 mis_high=2.0")
    ds = ppo.dynamic_sampling
    if ds.enabled:
        if ppo.n_samples_per_prompt < 2:
            raise ConfigError(f"ppo.dynamic_sampling.enabled=true drops groups whose rewards are all equal, but "
                              f"ppo.n_samples_per_prompt={ppo.n_samples_per_prompt}; fix: set it to 2 or more")
        _positive("ppo.dynamic_sampling", max_generation_rounds=ds.max_generation_rounds)
        if ds.prompts_per_round is not None:
            _positive("ppo.dynamic_sampling", prompts_per_round=ds.prompts_per_round)
        if ds.on_shortfall not in ("fill", "stop"):
            raise ConfigError(f"ppo.dynamic_sampling.on_shortfall={ds.on_shortfall!r}; fix: use 'fill' or 'stop'")
    if ppo.lr_schedule not in ("constant", "cosine"):
        raise ConfigError(f"ppo.lr_schedule={ppo.lr_schedule!r} is unknown; fix: use 'constant' or 'cosine'")
    if not 0 <= ppo.lr_warmup_ratio < 1:
        raise ConfigError(f"ppo.lr_warmup_ratio={ppo.lr_warmup_ratio} must be in [0, 1); fix: e.g. 0.03")
    if ppo.actor_lr <= 0 or ppo.critic_lr <= 0:
        raise ConfigError(f"ppo.actor_lr={ppo.actor_lr}, ppo.critic_lr={ppo.critic_lr} must be positive; fix: e.g. 1e-6")


def compute_plan(
    ppo: PPOConfig,
    run: RunLengthConfig,
    dataset_prompts: int,
    data_parallel_size: int = 1,
    max_response_tokens: int = 0,
    *,
    precision: str = "32-true",
    rollout_dtype: str = "float32",
    top_p: float = 1.0,
) -> StepPlan:
    """Derive every count of the run, or raise ConfigError naming the inconsistent keys.

    `precision` and `rollout_dtype` are resolved (`lit_ppo.precision`); `top_p` is vLLM's."""
    validate_ppo(ppo)
    if not isinstance(data_parallel_size, int) or data_parallel_size <= 0:
        raise ConfigError(f"strategy.devices x strategy.num_nodes = {data_parallel_size} ranks; fix: use at least 1 device and 1 node")
    if dataset_prompts <= 0:
        raise ConfigError(f"data: the prompt dataset is empty ({dataset_prompts} prompts); fix: point data at a file with prompts")
    samples_per_rollout_step = ppo.rollout_batch_size * ppo.n_samples_per_prompt
    if samples_per_rollout_step % ppo.train_batch_size:
        raise ConfigError(
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} x ppo.n_samples_per_prompt={ppo.n_samples_per_prompt} "
            f"= {samples_per_rollout_step} samples is not a multiple of ppo.train_batch_size={ppo.train_batch_size}; "
            f"fix: make train_batch_size a divisor of {samples_per_rollout_step}"
        )
    per_update_per_rank = ppo.micro_train_batch_size * data_parallel_size
    if ppo.train_batch_size % per_update_per_rank:
        raise ConfigError(
            f"ppo.train_batch_size={ppo.train_batch_size} is not a multiple of ppo.micro_train_batch_size={ppo.micro_train_batch_size} "
            f"x data-parallel size {data_parallel_size} = {per_update_per_rank}; fix: choose micro_train_batch_size dividing "
            f"{ppo.train_batch_size // data_parallel_size if ppo.train_batch_size % data_parallel_size == 0 else 'train_batch_size / ranks'}"
        )
    if ppo.rollout_batch_size % data_parallel_size:
        raise ConfigError(
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} prompts cannot be split evenly over {data_parallel_size} ranks; "
            f"fix: use a multiple of {data_parallel_size}"
        )
    if ppo.rollout_batch_size > dataset_prompts:
        raise ConfigError(
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} prompts is larger than the dataset ({dataset_prompts} prompts); "
            f"fix: set ppo.rollout_batch_size to at most {dataset_prompts} or use more data"
        )

    ds = ppo.dynamic_sampling
    per_round = (ds.prompts_per_round or ppo.rollout_batch_size) if ds.enabled else ppo.rollout_batch_size
    max_rounds = ds.max_generation_rounds if ds.enabled else 1
    if ds.enabled:
        if per_round % data_parallel_size or per_round > dataset_prompts:
            raise ConfigError(
                f"ppo.dynamic_sampling.prompts_per_round={per_round} must be a multiple of the {data_parallel_size} ranks and "
                f"at most the dataset's {dataset_prompts} prompts; fix: set ppo.dynamic_sampling.prompts_per_round"
            )
        if run.data_epochs is not None:
            raise ConfigError(
                f"trainer.data_epochs={run.data_epochs} with ppo.dynamic_sampling.enabled=true: the prompts a rollout step "
                "consumes vary, so data epochs do not give a number of rollout steps; fix: set trainer.total_rollout_steps "
                "(and trainer.data_epochs=null)"
            )
    rollout_steps_per_data_epoch = dataset_prompts // ppo.rollout_batch_size
    rounds_per_data_epoch = dataset_prompts // per_round
    dropped = dataset_prompts - rounds_per_data_epoch * per_round
    if (run.total_rollout_steps is None) == (run.data_epochs is None):
        raise ConfigError(
            f"trainer.total_rollout_steps={run.total_rollout_steps} and trainer.data_epochs={run.data_epochs}: "
            "set exactly one of the two; fix: e.g. trainer.total_rollout_steps=100 trainer.data_epochs=null"
        )
    if run.total_rollout_steps is not None:
        _positive("trainer", total_rollout_steps=run.total_rollout_steps)
        total_rollout_steps = run.total_rollout_steps
    else:
        if run.data_epochs <= 0:
            raise ConfigError(f"trainer.data_epochs={run.data_epochs} must be positive; fix: e.g. trainer.data_epochs=1")
        total_rollout_steps = max(1, math.ceil(run.data_epochs * rollout_steps_per_data_epoch - 1e-9))
    data_epochs = total_rollout_steps / rollout_steps_per_data_epoch

    mini_batches = samples_per_rollout_step // ppo.train_batch_size
    optimizer_steps_per_rollout_step = mini_batches * ppo.ppo_epochs
    total_optimizer_steps = optimizer_steps_per_rollout_step * total_rollout_steps
    samples = samples_per_rollout_step * total_rollout_steps
    notes = []
    if dropped:
        notes.append(
            f"each data epoch uses {rounds_per_data_epoch * per_round} of {dataset_prompts} prompts; "
            f"the last {dropped} (a partial {'generation round' if ds.enabled else 'rollout batch'}) are dropped and the order is reshuffled every data epoch"
        )
    if ds.enabled:
        notes.append(
            f"dynamic sampling: each rollout step draws rounds of {per_round} prompts ({max_rounds} at most) until "
            f"{ppo.rollout_batch_size} prompts with differing rewards are collected; the optimizer steps per rollout step "
            f"stay {optimizer_steps_per_rollout_step}. Data epochs and samples generated are lower bounds (up to "
            f"{max_rounds * per_round * total_rollout_steps / (rounds_per_data_epoch * per_round):.3f} data epochs and "
            f"{max_rounds * per_round * ppo.n_samples_per_prompt * total_rollout_steps} samples)"
        )
    elif abs(data_epochs - round(data_epochs)) > 1e-9:
        notes.append(f"the run ends inside data epoch {math.ceil(data_epochs)} ({data_epochs:.3f} data epochs)")
    warnings = []
    if top_p < 1:
        warnings.append(
            f"rollout.top_p={top_p} < 1: vLLM samples from the truncated distribution but the trainer's log-probs are of "
            "the whole one, so updates are off-distribution (rollout/logprob_abs_diff shows by how much); fix: top_p=1"
        )
    if precision == "bf16-true":
        warnings.append(
            "strategy.precision=bf16-true keeps weights and AdamW states in bf16: an update smaller than 2^-8 of a weight "
            "rounds away (lr 1e-6 on |w| = 0.02 changes almost nothing); fix: strategy.precision=bf16-mixed (float32 "
            "master weights)"
        )
    return StepPlan(
        data_parallel_size=data_parallel_size,
        dataset_prompts=dataset_prompts,
        rollout_batch_size=ppo.rollout_batch_size,
        n_samples_per_prompt=ppo.n_samples_per_prompt,
        samples_per_rollout_step=samples_per_rollout_step,
        rollout_steps_per_data_epoch=rollout_steps_per_data_epoch,
        prompts_dropped_per_data_epoch=dropped,
        total_rollout_steps=total_rollout_steps,
        data_epochs=data_epochs,
        prompt_passes=total_rollout_steps * ppo.rollout_batch_size / dataset_prompts,
        ppo_epochs=ppo.ppo_epochs,
        train_batch_size=ppo.train_batch_size,
        micro_train_batch_size=ppo.micro_train_batch_size,
        mini_batches_per_ppo_epoch=mini_batches,
        optimizer_steps_per_rollout_step=optimizer_steps_per_rollout_step,
        total_optimizer_steps=total_optimizer_steps,
        grad_accumulation_steps=ppo.train_batch_size // per_update_per_rank,
        samples_per_rank_per_rollout_step=samples_per_rollout_step // data_parallel_size,
        total_samples_generated=samples,
        max_response_tokens=max_response_tokens,
        max_tokens_generated=samples * max_response_tokens,
        lr_scheduler_unit="optimizer_step",
        lr_warmup_steps=math.ceil(ppo.lr_warmup_ratio * total_optimizer_steps),
        lr_total_steps=total_optimizer_steps,
        critic_enabled=ppo.advantage_estimator == "gae",
        reference_enabled=ppo.kl_coef > 0,
        dynamic_sampling=ds.enabled,
        prompts_per_generation_round=per_round,
        max_generation_rounds=max_rounds,
        generation_rounds_per_data_epoch=rounds_per_data_epoch,
        dynamic_sampling_on_shortfall=ds.on_shortfall,
        precision=precision,
        rollout_dtype=rollout_dtype,
        notes=notes,
        warnings=warnings,
    )
