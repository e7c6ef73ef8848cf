"""PPOModule: actor, critic and reference model trained with manual optimization.

One `training_step` is one rollout step:
  1. pull the rollout batch from the data module (vLLM generates it with the current weights),
  2. experience: old log-probs, reference log-probs and values, computed once, then advantages,
  3. `ppo_epochs` passes over the batch in shuffled mini-batches of `train_batch_size` samples,
     each accumulated over micro-batches of `micro_train_batch_size`, one optimizer step each,
  4. check that the actor and the critic took exactly the optimizer steps the plan says,
  5. push the actor's weights into vLLM.

Under data parallelism (DDP, or FSDP2 through Lightning's ModelParallelStrategy) each rank trains
on its share of the rollout batch; advantage statistics, loss denominators and the logged metrics
are global (all-reduced over ranks).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from lit_ppo import algorithms as algo
from lit_ppo.distributed import global_max, global_sum
from lit_ppo.errors import NonFiniteUpdatesError, RolloutMismatchError, StepAccountingError
from lit_ppo.logits import logprobs_and_entropy
from lit_ppo.plan import PPOConfig, StepPlan
from lit_ppo.report import write_metrics_csv
from lit_ppo.rewards import COUNT_METRICS

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


def pack(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, device) -> MicroBatch:
    """Left-pad prompts and right-pad responses so every response starts at column P."""
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r) for r in response_ids))
    B = len(prompt_ids)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[b, P - len(p):P] = torch.tensor(p)
        input_ids[b, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[b, P - len(p):P + len(r)] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention[:, P:].float()
    return MicroBatch(input_ids.to(device), attention.to(device), position_ids.to(device),
                      input_ids[:, P:].to(device), response_mask.to(device), P)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] without materialising the full log-softmax; [B, T]."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def prepare_for_training(model: torch.nn.Module, gradient_checkpointing: bool) -> torch.nn.Module:
    """Training mode with every dropout off, and gradient checkpointing when asked.

    `from_pretrained` returns a model in eval mode and Lightning keeps each submodule's mode, while Hugging Face
    checkpoints layers only in training mode: without this, model.gradient_checkpointing=true did nothing.
    Training mode must not switch dropout on (the critic's classifier_dropout is 0.1 by default): the ratio of
    new to old log-probs and the comparison with vLLM's assume one deterministic function of the weights."""
    for name, value in vars(model.config).items():
        if "dropout" in name and isinstance(value, float):
            setattr(model.config, name, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if gradient_checkpointing:
        # Non-reentrant: parameters get gradients even though the layers' inputs (embeddings of ids) need none.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return factor


class PPOModule(L.LightningModule):
    def __init__(self, *, model_dir: str, ppo: PPOConfig, plan: StepPlan, max_response_length: int, pad_token_id: int,
                 gradient_checkpointing: bool = False, eval_every: int = 0, max_consecutive_skipped_updates: int = 3,
                 metrics_path: str | None = None, temperature: float = 1.0, max_logprob_abs_diff: float | None = None):
        super().__init__()
        self.automatic_optimization = False
        self.ppo = ppo
        self.plan = plan
        self.max_response_length = max_response_length
        self.pad_token_id = pad_token_id
        self.eval_every = eval_every
        self.max_consecutive_skipped_updates = max_consecutive_skipped_updates
        self.metrics_path = metrics_path
        # vLLM samples from softmax(logits / temperature): every log-prob the trainer takes (old, reference,
        # new, entropy) is of that distribution, or the ratio and the KL compare the wrong ones.
        self.temperature = temperature
        self.max_logprob_abs_diff = max_logprob_abs_diff
        self.sharded = False  # FSDP2, set by configure_model
        self.actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.critic = None
        if plan.critic_enabled:
            self.critic = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
            # A zero value head: the critic starts at V = 0 everywhere, the same in every run and on every rank.
            torch.nn.init.zeros_(self.critic.score.weight)
            if self.critic.score.bias is not None:
                torch.nn.init.zeros_(self.critic.score.bias)
            # transformers reports the head as MISSING weights (in run.log); this is what it means.
            logging.getLogger("lit_ppo").info(
                "critic: the policy's weights with a new value head (%d -> 1), starting at zero",
                self.critic.score.in_features)
        self.reference = None
        if plan.reference_enabled:
            self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
        for model in (self.actor, self.critic):
            if model is not None:
                prepare_for_training(model, gradient_checkpointing)
        # The project's own counters; Lightning's global_step counts both optimizers' steps.
        self.rollout_step = 0
        self.actor_optimizer_steps = 0
        self.critic_optimizer_steps = 0
        self.samples_seen = 0
        self.kl_coef = ppo.kl_coef
        self.skipped_updates = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.consecutive_skipped_updates = 0
        self.shuffle_generator = torch.Generator().manual_seed(ppo.shuffle_seed)
        self.history: list[dict[str, Any]] = []  # one row per rollout step
        self.eval_history: list[dict[str, Any]] = []
        self.last_sample_use_counts: Tensor | None = None  # [ppo_epochs, N] for the accounting test
        self.rollout_correction_stats: dict[str, float] = {}  # of the last rollout step

    # ------------------------------------------------------------ sharding (FSDP2)

    def configure_model(self) -> None:
        """Under ModelParallelStrategy: FSDP2 `fully_shard` on every decoder layer, then on the rest, of each model.

        Other strategies have no device mesh and keep whole models."""
        if self.device_mesh is None or self.sharded:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        # bf16-mixed: float32 parameters, gradients and AdamW states (the shards), bf16 for the gathered
        # parameters that compute, gradients reduced in float32 (as verl and OpenRLHF train under FSDP).
        mixed = self.trainer.precision == "bf16-mixed"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
        for model in (self.actor, self.critic, self.reference):
            if model is None:
                continue
            layer_classes = set(model._no_split_modules or ())  # Hugging Face's name for its decoder layer class
            for layer in [m for m in model.modules() if type(m).__name__ in layer_classes]:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
        self.sharded = True

    def full_actor_tensors(self):
        """The actor's tensors by Hugging Face name, sharded ones gathered one at a time.

        Gathering is a collective under FSDP: every rank must iterate, in the same order. A parameter
        listed under two names (tied embeddings) is gathered once and given under both, as one tensor,
        so that `save_pretrained` still sees the tie."""
        state = self.actor.state_dict()
        # state_dict() gives each name its own tensor object; the parameters tell which names are one.
        parameter = {name: id(p) for name, p in self.actor.named_parameters(remove_duplicate=False)}
        key = {name: parameter.get(name, id(tensor)) for name, tensor in state.items()}
        listed = Counter(key.values())
        gathered: dict[int, Tensor] = {}
        for name, tensor in state.items():
            if not isinstance(tensor, DTensor):
                yield name, tensor
            elif listed[key[name]] == 1:
                yield name, tensor.full_tensor()
            else:
                if key[name] not in gathered:
                    gathered[key[name]] = tensor.full_tensor()
                yield name, gathered[key[name]]

    # ------------------------------------------------------------ optimizers

    def configure_optimizers(self):
        def make(model, lr):
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=self.ppo.weight_decay)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lr_lambda(self.plan.lr_warmup_steps, self.plan.lr_total_steps, self.ppo.lr_schedule))
            return opt, {"scheduler": sched, "interval": "step"}

        actor_opt, actor_sched = make(self.actor, self.ppo.actor_lr)
        if self.critic is None:
            return [actor_opt], [actor_sched]
        critic_opt, critic_sched = make(self.critic, self.ppo.critic_lr)
        return [actor_opt, critic_opt], [actor_sched, critic_sched]

    # ------------------------------------------------------------ forward helpers

    def _logits(self, model, mb: MicroBatch) -> Tensor:
        """Outputs at the positions that predict each response token: [B, T + 1, V] for a language model (the
        last position predicts nothing: slicing it off would make autograd allocate a padded gradient of the
        whole), [B, T, 1] for the critic. The sampling temperature is applied where the logits are read
        (`logprobs_and_entropy(..., temperature=self.temperature)`), chunk by chunk in float32."""
        T = mb.response_ids.shape[1]
        kwargs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
        if model is not self.critic:
            # Responses end the row, so only the last T + 1 positions need the LM head (vocab-sized).
            return model(**kwargs, logits_to_keep=T + 1).logits
        return model(**kwargs).logits[:, mb.prompt_width - 1:mb.prompt_width - 1 + T]

    def _values(self, mb: MicroBatch) -> Tensor:
        return self._logits(self.critic, mb)[..., 0].float()

    def response_logprobs(self, model, mb: MicroBatch) -> Tensor:
        """In float32 chunks (lit_ppo.logits): never a float32 copy of the whole [B, T, V]."""
        return logprobs_and_entropy(self._logits(model, mb), mb.response_ids, temperature=self.temperature)[0]

    def _micro_batches(self, batch, indices: list[int]):
        size = self.ppo.micro_train_batch_size
        for start in range(0, len(indices), size):
            idx = indices[start:start + size]
            yield idx, pack([batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx],
                            self.pad_token_id, self.device)

    # ------------------------------------------------------------ experience

    @torch.no_grad()
    def make_experience(self, batch) -> dict[str, Tensor]:
        """Old log-probs, reference log-probs and values (once per rollout step), then advantages."""
        N = len(batch.response_ids)
        T = max(1, max(len(r) for r in batch.response_ids))
        # float32 whatever the default dtype: under bf16-true Lightning makes bf16 the default inside training_step.
        exp = {k: torch.zeros(N, T, device=self.device, dtype=torch.float32) for k in ("old_logp", "ref_logp", "values", "mask")}
        for idx, mb in self._micro_batches(batch, list(range(N))):
            t = mb.response_ids.shape[1]
            exp["mask"][idx, :t] = mb.response_mask
            exp["old_logp"][idx, :t] = self.response_logprobs(self.actor, mb)
            if self.reference is not None:
                exp["ref_logp"][idx, :t] = self.response_logprobs(self.reference, mb)
            if self.critic is not None:
                exp["values"][idx, :t] = self._values(mb)
        mask = exp["mask"]
        if batch.rollout_logprobs is not None:
            exp["rollout_logp"] = torch.zeros(N, T, device=self.device, dtype=torch.float32)
            for i, logprobs in enumerate(batch.rollout_logprobs):
                exp["rollout_logp"][i, :len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
            exp["logprob_abs_diff_mean"], exp["logprob_abs_diff_max"] = self.check_rollout_logprobs(
                batch.rollout_step, exp["old_logp"], exp["rollout_logp"], mask)
        rewards = batch.rewards.to(self.device)
        kl = algo.KL_ESTIMATORS[self.ppo.kl_estimator](exp["old_logp"] - exp["ref_logp"]) * mask
        kl_penalty = self.kl_coef * kl if (self.reference is not None and self.ppo.kl_mode == "reward") else None
        estimator = algo.ADVANTAGE_ESTIMATORS[self.ppo.advantage_estimator]
        advantages, returns = estimator(
            rewards, mask, values=exp["values"], kl_penalty=kl_penalty, gamma=self.ppo.gamma, lam=self.ppo.lam,
            group_size=self.plan.n_samples_per_prompt, global_sum=global_sum, normalize=self.ppo.normalize_advantages,
        )
        exp.update(advantages=advantages, returns=returns, kl=kl, rewards=rewards)
        exp.update(self._rollout_correction(batch, exp))
        if os.environ.get(DUMP_ADVANTAGES_ENV):
            self._dump_experience(Path(os.environ[DUMP_ADVANTAGES_ENV]), batch, exp)
        return exp

    def _rollout_correction(self, batch, exp: dict[str, Tensor]) -> dict[str, Tensor]:
        """Weights on the policy loss for the mismatch between vLLM's sampling log-probs and the old log-probs, and
        the tokens the policy loss keeps (`ppo.rollout_correction`); all tokens with weight 1 when it is off."""
        rc = self.ppo.rollout_correction
        mask = exp["mask"]
        if rc.mode == "none":
            self.rollout_correction_stats = {}
            return {"rc_weights": mask.clone(), "loss_mask": mask.clone()}
        if "rollout_logp" not in exp:  # made by make_experience from batch.rollout_logprobs
            raise ValueError(f"ppo.rollout_correction.mode={rc.mode} needs the sampler's log-probs, but this rollout batch "
                             "has none (not generated by vLLM); fix: set ppo.rollout_correction.mode=none")
        weights, keep, stats = algo.rollout_correction(
            exp["old_logp"], exp["rollout_logp"], mask, mode=rc.mode, level=rc.level, tis_cap=rc.tis_cap, mis_low=rc.mis_low,
            mis_high=rc.mis_high, global_sum=global_sum, global_max=global_max)
        self.rollout_correction_stats = {f"rollout_correction/{k}": float(v) for k, v in stats.items()}
        return {"rc_weights": weights, "loss_mask": keep}

    def check_rollout_logprobs(self, rollout_step: int, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor):
        """Mean and max |trainer old log-prob - vLLM log-prob| over the global batch's response tokens (as 0-dim
        tensors); over `max_logprob_abs_diff` the run stops: the engine is not sampling from the actor being
        trained (a weight sync that silently failed, the most reported failure of RL trainers) or the two
        compute different distributions (temperature, top_p, dtype)."""
        diff = (old_logp - rollout_logp).abs() * mask  # [N, T]
        total = global_sum(torch.stack([diff.sum(), mask.sum()]).double())
        mean = total[0] / total[1].clamp(min=1)
        largest = global_max(diff.max().double() if diff.numel() else torch.zeros((), dtype=torch.float64, device=diff.device))
        if self.max_logprob_abs_diff is not None and float(mean) > self.max_logprob_abs_diff:
            raise RolloutMismatchError(
                f"rollout step {rollout_step + 1}: the trainer's log-probs of the sampled tokens differ from vLLM's by "
                f"{float(mean):.3f} nats per token on average (max {float(largest):.2f}), more than "
                f"rollout.max_logprob_abs_diff={self.max_logprob_abs_diff}: vLLM is not sampling from the actor being "
                "trained (a weight sync that failed) or samples another distribution (rollout.top_p < 1, rollout.dtype); "
                "fix: check the weight sync and those settings, or raise rollout.max_logprob_abs_diff (null disables)"
            )
        return mean, largest

    def _dump_experience(self, directory: Path, batch, exp: dict[str, Tensor]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({
            "rollout_step": batch.rollout_step, "rank": self.global_rank, "world_size": self.plan.data_parallel_size,
            "prompt_positions": batch.prompt_positions, "dataset_indices": batch.dataset_indices,
            "response_ids": batch.response_ids,
            **{k: exp[k].cpu() for k in ("rewards", "mask", "advantages", "returns", "values")},
        }, directory / f"rollout_step={batch.rollout_step:06d}.rank{self.global_rank}.pt")

    # ------------------------------------------------------------ PPO updates

    def minibatch_schedule(self, num_samples: int) -> list[list[list[int]]]:
        """Per PPO epoch, this rank's mini-batches of sample indices; reshuffled every epoch."""
        size = self.plan.train_batch_size // self.plan.data_parallel_size
        schedule = []
        for _ in range(self.plan.ppo_epochs):
            order = torch.randperm(num_samples, generator=self.shuffle_generator).tolist()
            schedule.append([order[start:start + size] for start in range(0, num_samples, size)])
        return schedule

    def train_on_experience(self, batch, exp: dict[str, Tensor]) -> dict[str, float]:
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        schedulers = self.lr_schedulers()
        schedulers = schedulers if isinstance(schedulers, list) else [schedulers]
        actor_opt, actor_sched = optimizers[0], schedulers[0]
        critic_opt = optimizers[1] if self.critic is not None else None
        critic_sched = schedulers[1] if self.critic is not None else None

        N = len(batch.response_ids)
        world = self.plan.data_parallel_size
        use_counts = torch.zeros(self.plan.ppo_epochs, N, dtype=torch.long)
        sums: dict[str, float] = {}
        micro_batches = updates = 0

        def add(key: str, value: float) -> None:
            sums[key] = sums.get(key, 0.0) + value

        for epoch, minibatches in enumerate(self.minibatch_schedule(N)):
            for indices in minibatches:
                use_counts[epoch, indices] += 1
                mask = exp["mask"][indices]
                # Denominators of the whole mini-batch over micro-batches and ranks, so that
                # accumulation and data parallelism do not change the loss (REFERENCE section 3). The policy loss
                # counts only the tokens the rollout correction keeps (all of them unless MIS drops some).
                num_tokens, num_seqs, num_policy_tokens = global_sum(torch.stack([
                    mask.sum(), torch.tensor(float(len(indices)), dtype=mask.dtype, device=mask.device),
                    exp["loss_mask"][indices].sum()]))
                last = math.ceil(len(indices) / self.ppo.micro_train_batch_size) - 1
                for position, (idx, mb) in enumerate(self._micro_batches(batch, indices)):
                    t = mb.response_ids.shape[1]
                    with self._gradient_sync(position == last):
                        stats = self._actor_backward(mb, {k: v[idx, :t] for k, v in exp.items() if v.dim() == 2},
                                                     num_policy_tokens, num_seqs, world)
                        for k, v in stats.items():
                            add(k, v)
                        micro_batches += 1
                        if self.critic is not None:
                            add("critic/value_loss", self._critic_backward(mb, exp, idx, t, num_tokens, world))
                add("actor/grad_norm", self._step(self.actor, actor_opt, actor_sched))
                self.actor_optimizer_steps += 1
                updates += 1
                if self.critic is not None:
                    add("critic/grad_norm", self._step(self.critic, critic_opt, critic_sched))
                    self.critic_optimizer_steps += 1
        self.last_sample_use_counts = use_counts
        if "critic/value_loss" in sums and world > 1:  # each rank's share is over the global token count
            sums["critic/value_loss"] = float(global_sum(torch.tensor(sums["critic/value_loss"], dtype=torch.float64, device=self.device)))
        # Per-update quantities (grad norms, the value loss summed over micro-batches) average over
        # updates; the actor's per-micro-batch statistics over micro-batches.
        metrics = {k: v / max(1, updates if k.startswith("critic/") or k.endswith("grad_norm") else micro_batches)
                   for k, v in sums.items()}
        if world > 1:  # the actor's per-micro-batch means: every rank ran as many micro-batches, so average the ranks
            keys = [k for k in metrics if k.startswith("actor/") and not k.endswith("grad_norm")]
            means = global_sum(torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)) / world
            metrics.update(zip(keys, means.tolist()))
        metrics["actor/lr"] = actor_sched.get_last_lr()[0]
        if critic_sched is not None:
            metrics["critic/lr"] = critic_sched.get_last_lr()[0]
        return metrics

    def _actor_backward(self, mb: MicroBatch, e: dict[str, Tensor], num_tokens, num_seqs, world: int) -> dict[str, float]:
        # Log-probs and entropy in float32 chunks; the entropy's gradient is computed only when the loss uses it
        # (entropy_coef > 0). The logits hold their own gradient after the backward pass.
        logp, entropy = logprobs_and_entropy(self._logits(self.actor, mb), mb.response_ids, temperature=self.temperature)
        mask = mb.response_mask
        pg_tok, clipped = algo.POLICY_LOSSES[self.ppo.policy_loss](
            logp, e["old_logp"], e["advantages"], mask, clip_ratio_low=self.ppo.clip_ratio_low,
            clip_ratio_high=self.ppo.clip_ratio_high, dual_clip=self.ppo.dual_clip)
        # Rollout-mismatch correction: weight each token's policy loss; the tokens MIS drops leave the loss (they
        # get weight 0 and are out of `loss_mask`, whose global count `num_tokens` is).
        pg_tok = pg_tok * e["rc_weights"]
        loss_tok = pg_tok
        if self.ppo.entropy_coef:
            loss_tok = loss_tok - self.ppo.entropy_coef * entropy
        if self.reference is not None and self.ppo.kl_mode == "loss":
            kl = algo.KL_ESTIMATORS[self.ppo.kl_estimator](logp - e["ref_logp"])
            loss_tok = loss_tok + self.kl_coef * kl
        agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=self.max_response_length)
        # Scaled by the world size because DDP averages gradients over ranks.
        loss = algo.aggregate_loss(loss_tok, e["loss_mask"], self.ppo.loss_agg_mode, **agg) * world
        self.manual_backward(loss)
        with torch.no_grad():
            log_ratio = (logp - e["old_logp"]) * mask
            denominator = mask.sum().clamp(min=1)
            return {
                "actor/policy_loss": float((pg_tok * mask).sum() / denominator),
                "actor/clip_fraction": float((clipped * mask).sum() / denominator),
                "actor/approx_kl": float((0.5 * log_ratio**2).sum() / denominator),
                "actor/entropy": float((entropy.detach() * mask).sum() / denominator),
            }

    def _critic_backward(self, mb: MicroBatch, exp, idx, t, num_tokens, world: int) -> float:
        values = self._values(mb)
        loss_tok, _ = algo.value_loss(values, exp["values"][idx, :t], exp["returns"][idx, :t], value_clip=self.ppo.value_clip)
        loss = algo.aggregate_loss(loss_tok, mb.response_mask, "token-mean", num_tokens=num_tokens) * world
        self.manual_backward(self.ppo.value_loss_coef * loss)
        return float(loss.detach()) / world

    @contextmanager
    def _gradient_sync(self, enabled: bool):
        """Gradients are synchronised over ranks once per optimizer step: the backward passes of a mini-batch's
        micro-batches before the last accumulate locally (DDP `no_sync`: no all-reduce; FSDP2
        `set_requires_gradient_sync(False)`: no reduce-scatter, the unsharded gradients accumulate on each rank),
        the last one reduces the sum. The same gradients as a sync per micro-batch (sums commute with the
        averaging), with 1/accumulation of the communication."""
        wrapper = self.trainer.strategy.model if self.plan.data_parallel_size > 1 else None
        if enabled or wrapper is None:
            yield
        elif isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
            with wrapper.no_sync():
                yield
        elif self.sharded:
            models = [m for m in (self.actor, self.critic) if m is not None]
            for model in models:
                model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                for model in models:
                    model.set_requires_gradient_sync(True)
        else:
            yield

    def _step(self, model, optimizer, scheduler) -> float:
        """Clip and apply one update; a non-finite gradient skips it (counted) instead of corrupting the weights.

        The scheduler steps either way: its length is the plan's number of optimizer steps."""
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.ppo.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if math.isfinite(grad_norm):
            optimizer.step()
            self.consecutive_skipped_updates = 0
        else:
            self.skipped_updates += 1
            self.consecutive_skipped_updates += 1
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if self.consecutive_skipped_updates >= self.max_consecutive_skipped_updates:
            raise NonFiniteUpdatesError(
                f"rollout step {self.rollout_step}: {self.consecutive_skipped_updates} optimizer steps in a row had a "
                f"non-finite loss or gradient ({self.skipped_updates} skipped in all); a checkpoint was saved; fix: lower "
                "ppo.actor_lr/critic_lr or check the rewards, then resume=auto"
            )
        return grad_norm if math.isfinite(grad_norm) else float("nan")

    # ------------------------------------------------------------ the rollout step

    def on_train_start(self) -> None:
        # The engine may hold other weights (a resumed run, a shared engine): start from the actor's.
        self.sync_weights(self.trainer.datamodule.start_engine())
        if not self.eval_history:
            self._evaluate()

    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)  # generation happens here, with the current weights
        datamodule = self.trainer.datamodule
        datamodule.engine.sleep()
        started = time.perf_counter()
        exp = self.make_experience(batch)
        experience_seconds = time.perf_counter() - started

        started = time.perf_counter()
        actor_before, critic_before = self.actor_optimizer_steps, self.critic_optimizer_steps
        train_metrics = self.train_on_experience(batch, exp)
        self.check_step_accounting(self.actor_optimizer_steps - actor_before, self.critic_optimizer_steps - critic_before)
        train_seconds = time.perf_counter() - started

        started = time.perf_counter()
        self.sync_weights(datamodule.engine)
        sync_seconds = time.perf_counter() - started

        self.rollout_step = batch.rollout_step + 1
        self.samples_seen += self.plan.samples_per_rollout_step
        self._update_kl_coef(exp)
        row = self._rollout_metrics(batch, exp)
        row.update(train_metrics)
        timings = {
            "timing/generate_s": batch.generate_seconds, "timing/reward_s": batch.reward_seconds,
            "timing/experience_s": experience_seconds, "timing/train_s": train_seconds, "timing/weight_sync_s": sync_seconds,
        }
        timings["timing/rollout_step_s"] = sum(timings.values())
        # The slowest rank's, which is what the run waits for.
        row.update(zip(timings, global_max(torch.tensor(list(timings.values()), dtype=torch.float64, device=self.device)).tolist()))
        row["perf/generated_tokens_per_s"] = row["rollout/generated_tokens"] / max(row["timing/generate_s"], 1e-9)
        if self.eval_every and self.rollout_step % self.eval_every == 0 and self.rollout_step < self.plan.total_rollout_steps:
            row.update(self._evaluate())
        if self.rollout_step == self.plan.total_rollout_steps:
            row.update(self._evaluate())
        self._log_row(row)

    def check_step_accounting(self, actor_steps: int, critic_steps: int) -> None:
        expected = self.plan.optimizer_steps_per_rollout_step
        expected_critic = expected if self.critic is not None else 0
        if actor_steps != expected or critic_steps != expected_critic:
            raise StepAccountingError(
                f"rollout step {self.rollout_step}: the actor took {actor_steps} and the critic {critic_steps} optimizer steps, "
                f"but the plan says {expected} each (ppo_epochs={self.plan.ppo_epochs} x {self.plan.mini_batches_per_ppo_epoch} "
                "mini-batches); the update loop is not doing what the configuration says"
            )

    @torch.no_grad()
    def sync_weights(self, engine) -> None:
        engine.wake_up()
        engine.sync_weights(self.full_actor_tensors())

    def _update_kl_coef(self, exp) -> None:
        if self.ppo.adaptive_kl_target is None or self.reference is None:
            return
        mask = exp["mask"]
        observed = float(global_sum((exp["kl"] * mask).sum()) / global_sum(torch.tensor(float(mask.shape[0]), dtype=mask.dtype, device=mask.device)))
        self.kl_coef = algo.adaptive_kl_coef(self.kl_coef, observed, self.ppo.adaptive_kl_target,
                                             self.plan.samples_per_rollout_step, self.ppo.adaptive_kl_horizon)

    def _rollout_metrics(self, batch, exp) -> dict[str, Any]:
        """Statistics of the global rollout batch: every rank adds its samples' sums (one all-reduce)."""
        mask = exp["mask"]
        lengths = mask.sum(-1)  # [N]
        rewards = exp["rewards"]
        valid = mask.bool()
        returns, values = exp["returns"][valid], exp["values"][valid]  # [tokens]
        local = {
            "samples": len(rewards), "reward": rewards.sum(), "reward_sq": (rewards ** 2).sum(),
            "tokens": lengths.sum(), "truncated": batch.truncated.sum(), "kl": (exp["kl"] * mask).sum(),
            "advantage": (exp["advantages"] * mask).sum(),
            "returns": returns.sum(), "returns_sq": (returns ** 2).sum(),
            "residual": (returns - values).sum(), "residual_sq": ((returns - values) ** 2).sum(),
        }
        if self.ppo.advantage_estimator in algo.GROUP_ESTIMATORS:
            local["uniform_groups"] = algo.count_uniform_groups(rewards, self.plan.n_samples_per_prompt)
        for k, v in batch.reward_metrics.items():  # per-rank means over equally many samples, or counts (summed)
            local[f"reward_{k}"] = v if k in COUNT_METRICS else v / self.plan.data_parallel_size
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in local.values()])
        total = dict(zip(local, global_sum(stacked).tolist()))
        n, tokens = total["samples"], total["tokens"]

        def variance(sum_: float, sum_sq: float, count: float) -> float:  # unbiased, as Tensor.var()
            return (sum_sq - sum_ ** 2 / count) / (count - 1) if count > 1 else 0.0

        row = {
            "rollout_step": self.rollout_step,
            "optimizer_step": self.actor_optimizer_steps,
            "data_epoch": batch.data_epoch,
            "samples_seen": self.samples_seen,
            "rollout/reward_mean": total["reward"] / n,
            "rollout/reward_std": max(0.0, variance(total["reward"], total["reward_sq"], n)) ** 0.5,
            "rollout/response_length_mean": tokens / n,
            "rollout/response_length_max": float(global_max(lengths.max().double())),
            "rollout/truncated_fraction": total["truncated"] / n,
            "rollout/generated_tokens": tokens,
            "rollout/advantage_mean": total["advantage"] / max(tokens, 1.0),
        }
        if self.reference is not None:  # without one, exp["kl"] compares with zeros and means nothing
            row["rollout/kl_to_reference"] = total["kl"] / max(tokens, 1.0)
            row["rollout/kl_coef"] = self.kl_coef
        if "logprob_abs_diff_mean" in exp:  # already global
            row["rollout/logprob_abs_diff"] = float(exp["logprob_abs_diff_mean"])
            row["rollout/logprob_abs_diff_max"] = float(exp["logprob_abs_diff_max"])
        if "uniform_groups" in total:
            row["rollout/uniform_reward_groups"] = int(total["uniform_groups"])
        if self.plan.dynamic_sampling:  # global counts already, the same on every rank
            row["rollout/generation_rounds"] = batch.generation_rounds
            row["rollout/dropped_groups"] = batch.dropped_groups
            row["rollout/filled_groups"] = batch.filled_groups
            row["rollout/prompts_consumed"] = batch.prompts_consumed
        row.update(self.rollout_correction_stats)
        if self.critic is not None:
            explained = variance(total["residual"], total["residual_sq"], tokens)
            row["critic/explained_variance"] = 1 - explained / max(variance(total["returns"], total["returns_sq"], tokens), 1e-8)
        for k in batch.reward_metrics:
            row[f"rollout/reward_{k}"] = total[f"reward_{k}"]
        return row

    def _evaluate(self) -> dict[str, Any]:
        result = self.trainer.datamodule.evaluate()
        if not result:
            return {}
        samples = result.pop("eval/samples")
        self.eval_history.append({"rollout_step": self.rollout_step, **result, "samples": samples})
        return result

    def _log_row(self, row: dict[str, Any]) -> None:
        row["actor/skipped_updates"] = self.skipped_updates
        self.history.append(row)
        if self.metrics_path and self.trainer.is_global_zero:
            write_metrics_csv(self.metrics_path, self.history)
        numeric = {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}
        for logger in self.loggers:
            logger.log_metrics(numeric, step=self.rollout_step)

    # ------------------------------------------------------------ checkpoint extras

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lit_ppo"] = {
            "rollout_step": self.rollout_step,
            "actor_optimizer_steps": self.actor_optimizer_steps,
            "critic_optimizer_steps": self.critic_optimizer_steps,
            "samples_seen": self.samples_seen,
            "kl_coef": self.kl_coef,
            "shuffle_generator": self.shuffle_generator.get_state(),
            "skipped_updates": self.skipped_updates,
            "history": self.history,
            "eval_history": self.eval_history,
            # NumPy's state as plain lists: the checkpoint then loads with torch.load(weights_only=True), which
            # Lightning uses when a strategy restores after setup (ModelParallelStrategy) whatever fit() was given.
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": [v.tolist() if isinstance(v, np.ndarray) else v for v in np.random.get_state()]},
            "plan": self.plan.to_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["lit_ppo"]
        self.rollout_step = state["rollout_step"]
        self.actor_optimizer_steps = state["actor_optimizer_steps"]
        self.critic_optimizer_steps = state["critic_optimizer_steps"]
        self.samples_seen = state["samples_seen"]
        self.kl_coef = state["kl_coef"]
        self.shuffle_generator.set_state(state["shuffle_generator"])
        self.skipped_updates = state["skipped_updates"]
        self.history = state["history"]
        self.eval_history = state["eval_history"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        name, keys, *rest = state["rng"]["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
        # A resumed run may be longer or shorter, but each rollout step must keep its shape.
        planned = {k: state["plan"][k] for k in ("optimizer_steps_per_rollout_step", "samples_per_rollout_step")}
        now = {k: getattr(self.plan, k) for k in planned}
        if planned != now:
            raise StepAccountingError(f"the checkpoint was written under another plan {planned}, this run plans {now}; "
                                      "fix: resume with the same ppo batch sizes and ppo_epochs")
