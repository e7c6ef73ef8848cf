"""PPOModule: actor, critic and reference model trained with manual optimization.

One `training_step` is one rollout step:
  1. pull the rollout batch from the data module (vLLM generates it with the current weights),
  2. experience: old log-probs (unless the plan takes them elsewhere: `StepPlan.old_logprobs_source`), reference
     log-probs and values, computed once, then advantages,
  3. `ppo_epochs` passes over the batch in shuffled mini-batches of `train_batch_size` samples,
     each accumulated over micro-batches of `micro_train_batch_size` samples (or of at most
     `micro_train_max_tokens` padded tokens), one optimizer step each,
  4. check that the actor and the critic took exactly the optimizer steps the plan says,
  5. push the actor's weights into vLLM (with `model.lora`: only the adapter, as a new adapter version).

Under data parallelism (DDP, or FSDP2 through Lightning's ModelParallelStrategy) each rank computes the experience
of its share of the rollout batch (packed: whole prompt groups split again over the ranks by real tokens,
`batching.balanced_rank_batch`), with global advantage statistics; then every rank gathers every rank's samples and
experience, and the mini-batches are drawn from those global samples, each rank training its share of each
(`batching.global_batch`, `rank_share`): the update is one process's on any number of ranks. Loss denominators and the
logged metrics are those of the global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from lit_ppo import algorithms as algo
from lit_ppo import preemption, waits
from lit_ppo.batch import RolloutBatch
from lit_ppo.checkpoints import check_same_adapters, check_same_models, module_state, restore_module_state
from lit_ppo.config import LoraConfig, PPOConfig
from lit_ppo.contract import AdapterWeights, WeightUpdate
from lit_ppo.distributed import full_tensors, global_max, global_sum, gradient_sync, shard_models
from lit_ppo.errors import ConfigError, WeightSyncError
from lit_ppo.packing import one_row, packing_unsupported
from lit_ppo.plan import (
    StepPlan,
    check_layout_tokens,
    check_micro_batches,
    check_policy_versions,
    check_sample_use,
    check_step_accounting,
    minibatch_schedule,
)
from lit_ppo.run.report import write_metrics_csv
from lit_ppo.training.batching import (
    MicroBatch,
    balanced_rank_batch,
    global_batch,
    pack,
    packed_micro_batches,
    rank_micro_batch_groups,
    rank_share,
)
from lit_ppo.training.experience import (
    DUMP_ADVANTAGES_ENV,
    Experience,
    dump_experience,
    experience_from_forwards,
    global_experience,
    loss_denominators,
    next_kl_coef,
    old_logprobs_from_training,
)
from lit_ppo.training.metrics import (
    MeanOver,
    actor_loss_shares,
    device_peak_memory_gib,
    rollout_step_row,
    update_metrics,
)
from lit_ppo.training.models import (
    adapter_disabled,
    adapter_tensors,
    critic_values,
    is_lora,
    load_models,
    response_logprobs_and_entropy,
    trained_state,
)
from lit_ppo.training.optim import GuardedStep, actor_critic_optimizers
from lit_ppo.training.packing_check import CHECKED_SAMPLES, check_packing
from lit_ppo.training.shared_prefix import prefix_tokens_saved, shared_prefix_unsupported


class PPOModule(L.LightningModule):
    def __init__(
        self,
        *,
        model_dir: str,
        ppo: PPOConfig,
        plan: StepPlan,
        pad_token_id: int,
        gradient_checkpointing: bool = False,
        eval_every: int = 0,
        max_consecutive_skipped_updates: int = 3,
        metrics_path: str | None = None,
        temperature: float = 1.0,
        max_logprob_abs_diff: float | None = None,
        lora: LoraConfig | None = None,
        attn_implementation: str | None = None,
    ):
        super().__init__()
        self.automatic_optimization = False
        self.ppo = ppo
        self.plan = plan
        self.pad_token_id = pad_token_id
        self.eval_every = eval_every
        self.metrics_path = metrics_path
        # vLLM samples from softmax(logits / temperature): every log-prob the trainer takes (old, reference,
        # new, entropy) is of that distribution, or the ratio and the KL compare the wrong ones.
        self.temperature = temperature
        self.max_logprob_abs_diff = max_logprob_abs_diff
        self.sharded = False  # FSDP2, set by configure_model
        self.actor, self.critic, self.reference = load_models(
            model_dir, plan, gradient_checkpointing, lora, attn_implementation
        )
        attention = self.actor.config._attn_implementation
        if plan.packing and (reason := packing_unsupported(self.actor.config.model_type, attention)):
            raise ConfigError(f"ppo.packing: {reason}; fix: set ppo.packing=false (padded micro-batches)")
        if plan.shared_prefix and (reason := shared_prefix_unsupported(self.actor.config, attention)):
            if ppo.shared_prefix:
                raise ConfigError(
                    f"ppo.shared_prefix=true: {reason}; fix: set ppo.shared_prefix=false (flat packed rows)"
                )
            # null, where the pre-flight did not know the model (a module built in code): flat packed rows
            logging.getLogger("lit_ppo").info("shared prefix: off, %s (ppo.shared_prefix=null)", reason)
            self.plan = plan = dataclasses.replace(plan, shared_prefix=False)
        self.one_row = one_row(attention)  # packed micro-batches in one row (varlen kernels), else balanced rows
        self.packing_checked = False  # the packed layout proven against the padded one (`check_packing`)
        self.lora = is_lora(self.actor)  # the reference is then the actor with its adapter disabled
        # A checkpoint holds the trained tensors only: the reference and LoRA's frozen base load from model_dir. Set
        # here, as Lightning's ModelParallelStrategy (FSDP) loads the weights before on_load_checkpoint.
        self.strict_loading = False  # checkpoints hold the trained tensors only; on_load_checkpoint checks them
        self.last_sync_bytes = 0  # pushed into the engine by the last weight sync
        # The project's own counters; Lightning's global_step counts both optimizers' steps.
        self.rollout_step = 0
        self.actor_optimizer_steps = 0
        self.critic_optimizer_steps = 0
        self.samples_seen = 0
        self.kl_coef = ppo.kl_coef
        self.guarded_step = GuardedStep(ppo.max_grad_norm, max_consecutive_skipped_updates)
        self.shuffle_generator = torch.Generator().manual_seed(ppo.shuffle_seed)
        self.history: list[dict[str, Any]] = []  # one row per rollout step
        self.eval_history: list[dict[str, Any]] = []
        self.last_sample_use_counts: Tensor | None = None  # [ppo_epochs, N] for the accounting test
        self.rollout_correction_stats: dict[str, float] = {}  # of the last rollout step
        self.rank_balance_stats: dict[str, float] = {}  # of the last rollout step (plan.rank_balance)

    # ------------------------------------------------------------ sharding (FSDP2)

    def configure_model(self) -> None:
        """Under ModelParallelStrategy: FSDP2 on each model. Other strategies have no device mesh and keep whole models."""
        if self.device_mesh is None or self.sharded:
            return
        shard_models(
            (self.actor, self.critic, self.reference),
            self.device_mesh["data_parallel"],
            bf16_mixed=self.trainer.precision == "bf16-mixed",
        )
        self.sharded = True

    def full_actor_tensors(self):
        """The actor's tensors by Hugging Face name, gathered if sharded (a collective: every rank calls it)."""
        return full_tensors(self.actor)

    def saved_actor_state(self) -> dict[str, Tensor]:
        """What the final `actor/` of a sharded actor is written from, gathered (a collective: every rank calls it):
        with LoRA the adapter alone (`save_pretrained(state_dict=...)` keys), else every tensor by Hugging Face name."""
        return trained_state(self.actor) if self.lora else dict(self.full_actor_tensors())

    # ------------------------------------------------------------ optimizers

    def configure_optimizers(self):
        return actor_critic_optimizers(self.actor, self.critic, self.ppo, self.plan)

    # ------------------------------------------------------------ forward helpers

    def _values(self, mb: MicroBatch) -> Tensor:
        return critic_values(self.critic, mb)

    def response_logprobs(self, model, mb: MicroBatch) -> Tensor:
        """In float32 chunks (lit_ppo.training.logits): never a float32 copy of the whole [B, T, V]."""
        return response_logprobs_and_entropy(model, mb, self.temperature)[0]

    def reference_logprobs(self, mb: MicroBatch) -> Tensor:
        """The reference model's log-probs: with LoRA the actor with its adapter disabled (the frozen base), no copy."""
        if self.lora:
            with adapter_disabled(self.actor):
                return self.response_logprobs(self.actor, mb)
        return self.response_logprobs(self.reference, mb)

    def _micro_batch_groups(self, batch: RolloutBatch, indices: list[int]) -> list[list[int]]:
        return rank_micro_batch_groups(batch, indices, self.ppo, self.plan, self.device)

    def _micro_batches(self, batch: RolloutBatch, groups: list[list[int]]):
        return packed_micro_batches(
            batch, groups, self.pad_token_id, self.device, self.plan.packing, self.one_row, self.plan.shared_prefix
        )

    @torch.no_grad()
    def check_packed_layout(self, batch: RolloutBatch) -> None:
        """The start-up check of ppo.packing (`packing_check.check_packing`): the first micro-batch's first samples,
        packed as the run lays them out, against each one's padded forward alone; every rank checks as many samples
        (under FSDP each forward is a collective)."""
        groups = self._micro_batch_groups(batch, list(range(len(batch.response_ids))))
        [(idx, packed)] = self._micro_batches(batch, groups[:1])
        count = min(CHECKED_SAMPLES, len(idx))
        count = -int(global_max(torch.tensor(-float(count), device=self.device)))  # the fewest of any rank
        alone = [
            mb for _, mb in packed_micro_batches(batch, [[i] for i in idx[:count]], self.pad_token_id, self.device)
        ]
        check_packing(self.actor, self.critic, packed, alone, self.temperature, self.plan.precision)
        self.packing_checked = True

    # ------------------------------------------------------------ experience

    @torch.no_grad()
    def make_experience(self, batch: RolloutBatch) -> Experience:
        """Old log-probs, reference log-probs and values (once per rollout step), then advantages."""
        N = len(batch.response_ids)
        T = max(1, max(len(r) for r in batch.response_ids))

        # float32 whatever the default dtype: under bf16-true Lightning makes bf16 the default here
        def zeros() -> Tensor:
            return torch.zeros(N, T, device=self.device, dtype=torch.float32)

        # The actor's forward only when the old log-probs come from it (StepPlan.old_logprobs_source): an exactly
        # on-policy update takes them from its own training forwards, ppo.old_logprobs=rollout from vLLM.
        source = self.plan.old_logprobs_source
        if source == "vLLM" and batch.rollout_logprobs is None:
            raise ConfigError(
                "ppo.old_logprobs=rollout takes vLLM's sampling log-probs as the old ones, but this rollout "
                "batch has none (not generated by vLLM); fix: set ppo.old_logprobs=auto"
            )
        mask = zeros()
        old_logp = zeros() if source == "experience forward" else None
        ref_logp = zeros() if self.plan.reference_enabled else None
        values = zeros() if self.critic is not None else None

        # Before the interruptible region: with a token budget under data parallelism the split all-reduces the ranks'
        # micro-batch counts, and a collective that a signal interrupts on one rank leaves the others waiting in it.
        groups = self._micro_batch_groups(batch, list(range(N)))

        def forwards() -> None:
            for idx, mb in self._micro_batches(batch, groups):
                t = mb.response_ids.shape[1]
                mask[idx, :t] = mb.response_mask
                if old_logp is not None:
                    old_logp[idx, :t] = self.response_logprobs(self.actor, mb)
                if ref_logp is not None:
                    ref_logp[idx, :t] = self.reference_logprobs(mb)
                if values is not None:  # zero off the response mask (padding, observations)
                    values[idx, :t] = self._values(mb) * mb.response_mask

        # Nothing kept yet: a preemption signal drops these forwards and the step (lit_ppo.preemption). Not under
        # FSDP, whose forwards gather shards with the other ranks: interrupted on one rank, they would wait forever.
        if self.sharded:
            forwards()
        else:
            preemption.interruptibly(forwards)
        preemption.stop_point(self.device)
        exp, self.rollout_correction_stats = experience_from_forwards(
            batch,
            mask,
            old_logp,
            ref_logp,
            values,
            self.ppo,
            self.plan,
            kl_coef=self.kl_coef,
            max_logprob_abs_diff=self.mismatch_bound(batch),
        )
        if os.environ.get(DUMP_ADVANTAGES_ENV):
            dump_experience(
                Path(os.environ[DUMP_ADVANTAGES_ENV]), batch, exp, self.global_rank, self.plan.data_parallel_size
            )
        return exp

    def mismatch_bound(self, batch: RolloutBatch) -> float | None:
        """rollout.max_logprob_abs_diff for this batch: the trainer's old log-probs against vLLM's catch a failed
        weight sync only when both are of the same policy version. A stale batch (rollout.max_staleness > 0) differs
        by what k updates changed, which is logged (rollout/logprob_abs_diff) and corrected, not a failure; its
        version's weights were checked where they arrived (the rollout workers' probe, lit_ppo.rollout.disaggregated)."""
        stale = batch.policy_versions is not None and any(v != batch.rollout_step for v in batch.policy_versions)
        return None if stale else self.max_logprob_abs_diff

    @torch.no_grad()
    def weight_probe(self, batch: RolloutBatch | None) -> tuple[list[int], list[int], list[float]] | None:
        """A sequence and the actor's log-probs of its response tokens (temperature 1, as vLLM's prompt log-probs),
        for rollout workers to check the weights they apply against: (prompt ids, response ids, log-probs)."""
        if batch is None or not batch.response_ids or not batch.response_ids[0]:
            return None
        prompt, response = batch.prompt_ids[0], batch.response_ids[0]
        mb = pack([prompt], [response], self.pad_token_id, self.device)
        logp = response_logprobs_and_entropy(self.actor, mb, temperature=1.0)[0][0]
        return list(prompt), list(response), logp[: len(response)].tolist()

    # ------------------------------------------------------------ PPO updates

    def minibatch_schedule(self, num_samples: int) -> list[list[list[int]]]:
        return minibatch_schedule(self.plan, num_samples, self.shuffle_generator)

    def train_on_experience(self, batch: RolloutBatch, exp: Experience) -> dict[str, float]:
        """`ppo_epochs` passes over the rollout step's global batch, one optimizer step per global mini-batch of
        train_batch_size samples, of which this rank trains its share (`rank_share`): the mini-batches are the same
        sets of samples on any number of ranks, so the update is one process's. Returns the updates' mean metrics."""
        optimizers, schedulers = self.optimizers(), self.lr_schedulers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        schedulers = schedulers if isinstance(schedulers, list) else [schedulers]
        models = [m for m in (self.actor, self.critic) if m is not None]
        world = self.plan.data_parallel_size
        # Every rank's samples and experience, in one process's order: the mini-batches are drawn from them.
        full, picks, own = global_batch(batch, self.global_rank)
        full_exp = global_experience(exp, picks)
        N = len(full.response_ids)
        actor_steps_at_start = self.actor_optimizer_steps
        use_counts = torch.zeros(self.plan.ppo_epochs, N, dtype=torch.long)
        per_update = MeanOver("optimizer update")
        # Without an experience forward, the log-probs of the forwards before the first optimizer step (all of them
        # when on-policy) are the actor's before the update: kept for the old log-probs, the KL and the vLLM check.
        captured = torch.zeros_like(full_exp.mask) if self.plan.old_logprobs_source != "experience forward" else None
        captured_rows = torch.zeros(N, dtype=full_exp.mask.dtype, device=full_exp.mask.device)
        lengths = [len(p) for p in full.prompt_ids], [len(r) for r in full.response_ids]
        positions = real_tokens = micro_batches = prefix_saved = 0
        for epoch, minibatches in enumerate(self.minibatch_schedule(N)):
            for minibatch in minibatches:
                indices = rank_share(full, minibatch, self.plan, self.global_rank)
                use_counts[epoch, indices] += 1
                before_first_step = self.actor_optimizer_steps == actor_steps_at_start
                num_tokens, num_seqs, num_policy_tokens = loss_denominators(full_exp, minibatch)
                groups = self._micro_batch_groups(full, indices)
                real = [sum(lengths[0][i] + lengths[1][i] for i in g) for g in groups]
                laid_out = []
                real_tokens += sum(real)
                micro_batches += len(groups)
                for position, (idx, mb) in enumerate(self._micro_batches(full, groups)):
                    positions += mb.positions
                    laid_out.append((len(idx), real[position] if mb.packed else mb.positions))
                    if mb.layout_tokens is not None:  # shared prefix: each group's prompt once, proven here
                        saved = prefix_tokens_saved([full.prompt_ids[i] for i in idx])
                        check_layout_tokens(self.plan, self.rollout_step, mb.layout_tokens, real[position], saved)
                        prefix_saved += saved
                    # The optimizer steps change the models: the step is dropped on preemption only if its start
                    # is on disk; otherwise it finishes and the run stops after it.
                    preemption.stop_point(self.device, module=self)
                    rows = full_exp.rows(idx, mb.response_ids.shape[1])
                    with gradient_sync(position == len(groups) - 1, self.trainer.strategy.model, models, self.sharded):
                        shares, logp = self._actor_backward(mb, rows, num_policy_tokens, num_seqs, world)
                        per_update.add(shares)
                        if captured is not None and before_first_step:
                            captured[idx, : logp.shape[1]] = logp
                            captured_rows[idx] = 1.0
                        if self.critic is not None:  # the update's value loss, one micro-batch's share at a time
                            per_update.add({"critic/value_loss": self._critic_backward(mb, rows, num_tokens, world)})
                check_micro_batches(self.plan, self.rollout_step, laid_out)
                grad_norm = self.guarded_step(self.actor, optimizers[0], schedulers[0], self.rollout_step)
                per_update.add({"actor/grad_norm": grad_norm})
                self.actor_optimizer_steps += 1
                if self.critic is not None:
                    grad_norm = self.guarded_step(self.critic, optimizers[1], schedulers[1], self.rollout_step)
                    per_update.add({"critic/grad_norm": grad_norm})
                    self.critic_optimizer_steps += 1
                per_update.count()
        # Over the ranks: each sample's uses (each rank counted its own), checked against the plan by training_step.
        self.last_sample_use_counts = global_sum(use_counts.to(self.device)).cpu()
        if captured is not None:  # each captured row was written by the one rank that trained it
            captured, captured_rows = global_sum(captured)[own], global_sum(captured_rows)[own]
            width = exp.mask.shape[1]
            old_logprobs_from_training(
                exp, captured[:, :width], captured_rows, batch, self.ppo, self.mismatch_bound(batch)
            )
        metrics = update_metrics(
            per_update,
            positions,
            real_tokens,
            device=self.device,
            global_sum=global_sum,
            prefix_tokens_saved=prefix_saved,
        )
        micro_batches = float(global_sum(torch.tensor(float(micro_batches), dtype=torch.float64, device=self.device)))
        metrics["perf/real_tokens_per_micro_batch"] = metrics["perf/trained_tokens"] / max(micro_batches, 1.0)
        metrics["perf/padded_tokens_per_micro_batch"] = metrics["perf/trained_positions"] / max(micro_batches, 1.0)
        metrics["actor/lr"] = schedulers[0].get_last_lr()[0]
        if self.critic is not None:
            metrics["critic/lr"] = schedulers[1].get_last_lr()[0]
        return metrics

    def _actor_backward(
        self, mb: MicroBatch, e: Experience, num_tokens, num_seqs, world: int
    ) -> tuple[dict[str, float], Tensor]:
        """One micro-batch's share of the actor loss, backpropagated; its shares of the mini-batch's actor statistics
        (`actor_loss_shares`) and its log-probs (detached)."""
        # Float32 chunks; entropy's gradient only when the loss uses it. The logits ([n, V] packed, [B, T + 1, V]
        # padded) are not kept here: autograd frees them (their gradient written over them) once the LM head's
        # backward has read them.
        logp, entropy = response_logprobs_and_entropy(self.actor, mb, self.temperature)
        mask = mb.response_mask
        # Exactly on-policy without an experience forward: these weights generated the batch, so the old log-probs
        # are these log-probs (ratio 1, the same gradient as with a forward that computed them before).
        old_logp = e.old_logp if e.old_logp is not None else logp.detach()
        p = self.ppo
        loss_tok, pg_tok, clipped = algo.actor_token_loss(
            logp,
            old_logp,
            e.advantages,
            mask,
            entropy,
            policy_loss=p.policy_loss,
            clip_ratio_low=p.clip_ratio_low,
            clip_ratio_high=p.clip_ratio_high,
            dual_clip=p.dual_clip,
            rc_weights=e.rc_weights,
            entropy_coef=p.entropy_coef,
            ref_logp=e.ref_logp if p.kl_mode == "loss" else None,
            kl_estimator=p.kl_estimator,
            kl_coef=self.kl_coef,
        )
        agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=self.plan.max_response_tokens)
        # Scaled by the world size because DDP averages gradients over ranks.
        loss = algo.aggregate_loss(loss_tok, e.loss_mask, self.ppo.loss_agg_mode, **agg) * world
        self.manual_backward(loss)
        shares = actor_loss_shares(pg_tok, clipped, logp, old_logp, entropy, e.loss_mask, self.ppo.loss_agg_mode, **agg)
        return shares, logp.detach()

    def _critic_backward(self, mb: MicroBatch, e: Experience, num_tokens, world: int) -> float:
        values = self._values(mb)
        loss_tok, _ = algo.value_loss(values, e.values, e.returns, value_clip=self.ppo.value_clip)
        loss = algo.aggregate_loss(loss_tok, mb.response_mask, "token-mean", num_tokens=num_tokens) * world
        self.manual_backward(self.ppo.value_loss_coef * loss)
        return float(loss.detach()) / world

    # ------------------------------------------------------------ the rollout step

    def on_train_start(self) -> None:
        # The engine may hold other weights (a resumed run, a shared engine): start from the actor's.
        engine = self.trainer.datamodule.start_engine()
        device_peak_memory_gib(self.device)  # each rollout step's peak starts here: loading is not counted
        waits.entering("the weight sync before rollout step 1")
        self.sync_weights(engine, self.rollout_step)
        if not self.eval_history:
            waits.entering("the evaluation before rollout step 1")
            self._log_initial_evaluation(self._evaluate())

    def _initial_row(self) -> dict[str, Any] | None:
        """The evaluation before any update, as the rollout_step 0 row of metrics.csv and the loggers; None when the
        run has none (no held-out prompts). Built from `eval_history`, which checkpoints keep, so a resumed run
        writes it again."""
        if not self.eval_history or self.eval_history[0]["rollout_step"] != 0:
            return None
        evaluation = {k: v for k, v in self.eval_history[0].items() if k.startswith("eval/")}
        return {"rollout_step": 0, "optimizer_step": 0, "data_epoch": 0, "samples_seen": 0, **evaluation}

    def _log_initial_evaluation(self, result: dict[str, Any]) -> None:
        row = self._initial_row()
        if not result or row is None:
            return
        if self.metrics_path and self.trainer.is_global_zero:
            write_metrics_csv(self.metrics_path, self.history, initial=row)
        numeric = {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}
        for logger in self.loggers:
            logger.log_metrics(numeric, step=0)

    def training_step(self, dataloader_iter):
        # 1. The rollout batch: the data module generates it with the current weights and scores it.
        waits.entering(f"rollout step {self.rollout_step + 1}'s generation and rewards")
        batch, _, _ = next(dataloader_iter)
        waits.entering(f"rollout step {batch.rollout_step + 1}'s experience and updates")
        # The proof of the generation schedule: every sample is of the policy version the plan states.
        check_policy_versions(self.plan, batch.rollout_step, batch.policy_versions)
        engine = self.trainer.datamodule.engine
        check_adapter_versions(batch, self.plan)
        engine.sleep()  # frees vLLM's memory for the updates
        started = time.perf_counter()
        # Packed under data parallelism: the ranks' prompt groups split again by real tokens (after the engine's
        # sleep: under NCCL the all-gather's buffers are on the device; timed with the experience).
        self.rank_balance_stats = {}
        if self.plan.rank_balance:
            batch, self.rank_balance_stats = balanced_rank_batch(batch, self.plan, self.global_rank)
        if self.plan.packing and not self.packing_checked:  # once per process: a resumed run checks again
            self.check_packed_layout(batch)
        # 2. Experience: old log-probs, reference log-probs, values and advantages, once.
        exp = self.make_experience(batch)
        experience_seconds, started = time.perf_counter() - started, time.perf_counter()
        # 3. The PPO updates, and 4. the check that they took the optimizer steps the plan says.
        actor_before, critic_before = self.actor_optimizer_steps, self.critic_optimizer_steps
        train_metrics = self.train_on_experience(batch, exp)
        check_step_accounting(
            self.plan,
            self.rollout_step,
            self.actor_optimizer_steps - actor_before,
            self.critic_optimizer_steps - critic_before,
        )
        check_sample_use(self.plan, self.rollout_step, self.last_sample_use_counts.tolist())
        train_seconds, started = time.perf_counter() - started, time.perf_counter()
        # Real tokens (prompt + response) through the training forwards and backwards, per second of the phase.
        train_metrics["perf/tokens_per_second"] = train_metrics["perf/trained_tokens"] / max(train_seconds, 1e-9)
        # 5. The new weights into vLLM, for the next rollout batch.
        waits.entering(f"the weight sync after rollout step {batch.rollout_step + 1}")
        self.sync_weights(engine, version=batch.rollout_step + 1, probe_batch=batch)
        sync_seconds = time.perf_counter() - started

        self.rollout_step = batch.rollout_step + 1
        self.samples_seen += self.plan.samples_per_rollout_step
        self.kl_coef = next_kl_coef(self.kl_coef, exp, self.ppo, self.plan.samples_per_rollout_step)
        timings = {
            "timing/generate_s": batch.generate_seconds,
            "timing/reward_s": batch.reward_seconds,
            "timing/experience_s": experience_seconds,
            "timing/train_s": train_seconds,
            "timing/weight_sync_s": sync_seconds,
        }
        if batch.wait_seconds is not None:  # rollout workers: generation overlapped training; the wait is its cost
            timings["timing/generate_s"] = batch.wait_seconds
        peak_gib = device_peak_memory_gib(self.device)  # since the last step's end: its generation, updates, sync
        if peak_gib is not None:
            train_metrics["perf/device_peak_memory_gib"] = peak_gib
        self._log_row(self._rollout_step_row(batch, exp, train_metrics, timings))

    @torch.no_grad()
    def sync_weights(self, engine, version: int | None = None, probe_batch: RolloutBatch | None = None) -> None:
        """The actor's weights into the engine as policy `version` (the rollout steps it has taken; None:
        `self.rollout_step`): with LoRA into vLLM only the adapter, as adapter `adapter_version(version)` (the engine
        checks it serves it); otherwise every tensor. Rollout workers (rollout.mode=disaggregated) record `version`
        on every sample they generate with either and check what they applied against a probe of `probe_batch`.
        Records the bytes pushed (`perf/weight_sync_bytes`)."""
        engine.wake_up()
        version = self.rollout_step if version is None else version
        probe = functools.partial(self.weight_probe, probe_batch)  # called by the engines that check (rollout workers)
        if self.lora:
            adapter = AdapterWeights(adapter_tensors(self.actor), self.adapter_config(), adapter_version(version))
            update = WeightUpdate(version, adapter=adapter, probe=probe)
        else:
            update = WeightUpdate(version, tensors=self.full_actor_tensors(), probe=probe)
        self.last_sync_bytes = engine.update_weights(update)

    def adapter_config(self) -> dict:
        """The actor's peft adapter config as plain values (what vLLM reads from adapter_config.json)."""
        config = self.actor.peft_config["default"].to_dict()
        return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}

    def _rollout_step_row(
        self, batch, exp: Experience, train_metrics: dict[str, float], timings: dict[str, float]
    ) -> dict[str, Any]:
        counters = {
            "rollout_step": self.rollout_step,
            "optimizer_step": self.actor_optimizer_steps,
            "data_epoch": batch.data_epoch,
            "samples_seen": self.samples_seen,
        }
        extra = {
            **self.rollout_correction_stats,
            **self.rank_balance_stats,
            **({"rollout/kl_coef": self.kl_coef} if self.plan.reference_enabled else {}),
            "perf/weight_sync_bytes": float(self.last_sync_bytes),
        }
        if batch.policy_versions:  # rollout steps between the generating policy and the one this step starts from
            extra["rollout/policy_version_lag"] = batch.rollout_step - sum(batch.policy_versions) / len(
                batch.policy_versions
            )
        if batch.wait_seconds is not None:  # the workers' own generation time (overlapped with training)
            extra["rollout/worker_generate_s"] = batch.generate_seconds
        row = rollout_step_row(
            batch,
            exp,
            train_metrics,
            timings,
            counters=counters,
            plan=self.plan,
            ppo=self.ppo,
            extra=extra,
            global_sum=global_sum,
            global_max=global_max,
        )
        last = self.rollout_step == self.plan.total_rollout_steps
        if last or (self.eval_every and self.rollout_step % self.eval_every == 0):
            waits.entering(f"the evaluation after rollout step {self.rollout_step}")
            row.update(self._evaluate())
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
            write_metrics_csv(self.metrics_path, self.history, initial=self._initial_row())
        numeric = {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}
        for logger in self.loggers:
            logger.log_metrics(numeric, step=self.rollout_step)

    # ------------------------------------------------------------ checkpoint extras

    @property
    def skipped_updates(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient, in all (checkpointed)."""
        return self.guarded_step.skipped

    def frozen_parameter_names(self) -> set[str]:
        """The names of parameters that never train (the reference model; LoRA's base weights): loaded from model_dir,
        never checkpointed (`state_dict` leaves them out)."""
        return {name for name, p in self.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def state_dict(self, *args, **kwargs) -> dict:
        """The trained tensors only, what a checkpoint holds: not the reference model, nor with LoRA the frozen base
        (model_dir has both, and the run loads them from it). On the H200 the reference was a quarter of a full
        Qwen2.5-1.5B run's checkpoint (6 of 25 GB: weights, AdamW states, reference). Under FSDP, Lightning's
        ModelParallelStrategy gathers on rank 0 what this lists (`get_model_state_dict`), so a checkpoint never
        gathers the frozen weights either."""
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")  # within a wrapper's state_dict (DDP's)
        for name in self.frozen_parameter_names():
            state.pop(prefix + name, None)
        return state

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lit_ppo"] = module_state(self)  # beside Lightning's weights, optimizers and schedulers

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_same_models(checkpoint["lit_ppo"]["plan"], self.plan)
        if self.lora and "state_dict" not in checkpoint:
            # FSDP: ModelParallelStrategy has loaded the checkpoint's tensors before this hook (not strictly: the frozen
            # base is not there) and taken them out of `checkpoint`; its plan says which adapters they were.
            check_same_adapters(checkpoint["lit_ppo"]["plan"], self.plan)
        elif "state_dict" in checkpoint:
            # Lightning loads the weights after this hook, the checkpoint's keys only: each trained one must be there.
            missing = sorted(set(self.state_dict()) - set(checkpoint["state_dict"]))
            if missing:
                raise ConfigError(
                    f"the checkpoint lacks {len(missing)} trained tensors of this run (e.g. {missing[0]}); fix: "
                    "resume with the model settings (model.lora included) it was written with"
                )
        restore_module_state(self, checkpoint["lit_ppo"])


def adapter_version(rollout_steps_trained: int) -> int:
    """The LoRA adapter version of the actor after `rollout_steps_trained` rollout steps of updates: vLLM's adapter
    id (from 1), increasing with every sync, and the same in a resumed run as in an uninterrupted one."""
    return rollout_steps_trained + 1


def check_adapter_versions(batch: RolloutBatch, plan: StepPlan) -> None:
    """The runtime proof of the adapter-only sync: every sample of rollout step k (counted from 0; the message counts
    from 1, as the stale-weight gate's does) was generated by the adapter of the policy version the plan gives the
    step (`StepPlan.generating_version`: k, or max(0, k - max_staleness) with rollout workers), adapter version
    v + 1 for the actor after v rollout steps. A sync that was skipped or lost stops the run here, within one rollout
    step."""
    if batch.adapter_versions is None or plan.rollout_engine != "vllm":
        return  # no LoRA; or the engine is the actor itself (rollout.engine=hf)
    policy_version = plan.generating_version(batch.rollout_step)
    expected = adapter_version(policy_version)
    stale = sorted({v for v in batch.adapter_versions if v != expected})
    if stale:
        logs = "logs/rollout_worker<N>.log" if plan.rollout_mode == "disaggregated" else "logs/run.log"
        raise WeightSyncError(
            f"rollout step {batch.rollout_step + 1}: vLLM sampled with LoRA adapter version(s) {stale}, but the trainer's "
            f"adapter of policy version {policy_version} is version {expected}: the adapter sync did not reach the "
            f"engine; fix: report it with {logs} (the rollouts were not from the trained policy)"
        )
