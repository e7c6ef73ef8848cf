"""PPOModule: actor, critic and reference model trained with manual optimization.

One `training_step` is one rollout step:
  1. pull the rollout batch from the data module (vLLM generates it with the current weights),
  2. experience: old log-probs (unless the plan takes them elsewhere: `StepPlan.old_logprobs.source`), reference
     log-probs (on-policy distillation: the teacher's too) and values, computed once, then advantages,
  3. `ppo_epochs` passes over the batch in shuffled mini-batches of `train_batch_size` samples,
     each accumulated over micro-batches of `micro_train_batch_size` samples (or of at most
     `micro_train_max_tokens` padded tokens), one optimizer step each,
  4. check that the actor and the critic took exactly the optimizer steps the plan says,
  5. push the actor's weights into vLLM (with `model.lora`: only the adapter, as a new adapter version).

Under data parallelism (DDP, or FSDP2 through Lightning's ModelParallelStrategy) each rank computes the experience
of its share of the rollout batch (packed: whole prompt groups split again over the ranks by real tokens,
`rank_samples.balanced_rank_batch`), with global advantage statistics; then every rank gathers every rank's samples
and experience, and the mini-batches are drawn from those global samples, each rank training its share of each
(`rank_samples.global_batch`, `rank_share`): the update is one process's on any number of ranks. Loss denominators
and the logged metrics are those of the global batch. Mixed in: the optimizers (training/optim.py), the weight sync
(training/weight_sync.py), the evaluations (training/evaluation.py) and what a checkpoint holds of the module
(training/state.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from lit_ppo import preemption, waits
from lit_ppo.batch import RolloutBatch
from lit_ppo.config import LoraConfig, PPOConfig
from lit_ppo.distributed import full_tensors, global_max, global_sum, gradient_sync, shard_models
from lit_ppo.errors import ConfigError
from lit_ppo.plan import StepPlan, check_batch_versions, check_sample_use, check_step_accounting, minibatch_schedule
from lit_ppo.topology import RankTopology
from lit_ppo.training.batching import MicroBatch, check_rollout_ids, packed_micro_batches
from lit_ppo.training.context_parallel import ContextGroup, logprobs_and_entropy, values_of
from lit_ppo.training.evaluation import Evaluations
from lit_ppo.training.experience import (
    DUMP_ADVANTAGES_ENV,
    Experience,
    OldLogprobCapture,
    dump_experience,
    experience_from_forwards,
    global_experience,
    loss_denominators,
    next_kl_coef,
    teacher_metrics,
)
from lit_ppo.training.layout import MicroBatchLayout
from lit_ppo.training.loss import LossInputs, actor_loss, critic_loss
from lit_ppo.training.metrics import MeanOver, device_peak_memory_gib, rollout_step_row, update_metrics
from lit_ppo.training.models import adapter_disabled, is_lora, load_models, trained_state
from lit_ppo.training.numerics import FirstMiniBatchRatio
from lit_ppo.training.optim import GuardedStep, ModuleOptimizers, apply_learning_rates
from lit_ppo.training.packing import fixed_row, one_row, packing_unsupported, shared_prefix_unsupported
from lit_ppo.training.packing_check import CHECKED_SAMPLES, check_packing
from lit_ppo.training.rank_samples import balanced_rank_batch, global_batch, rank_share
from lit_ppo.training.state import CheckpointedModule
from lit_ppo.training.teacher import load_teacher, server_teacher_logprobs, teacher_logprobs
from lit_ppo.training.weight_sync import WeightSync, check_adapter_versions


class PPOModule(ModuleOptimizers, WeightSync, Evaluations, CheckpointedModule, L.LightningModule):
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
        # vLLM samples from softmax(logits / temperature): every log-prob the trainer takes (old, reference,
        # new, entropy) is of that distribution, or the ratio and the KL compare the wrong ones.
        self.temperature = temperature
        self.max_logprob_abs_diff = max_logprob_abs_diff
        self.sharded = False  # FSDP2, set by configure_model
        self.topology = RankTopology()  # this process's ranks: build_run's, from the trainer's strategy
        self.actor, self.critic, self.reference = load_models(
            model_dir, plan, gradient_checkpointing, lora, attn_implementation
        )
        self.teacher = load_teacher(plan, attn_implementation)  # on-policy distillation's; frozen, never checkpointed
        attention = self.actor.config._attn_implementation
        if plan.layout.packing and (reason := packing_unsupported(self.actor.config.model_type, attention)):
            raise ConfigError(f"ppo.packing: {reason}; fix: set ppo.packing=false (padded micro-batches)")
        if plan.layout.shared_prefix and (reason := shared_prefix_unsupported(self.actor.config, attention)):
            if ppo.shared_prefix:
                raise ConfigError(
                    f"ppo.shared_prefix=true: {reason}; fix: set ppo.shared_prefix=false (flat packed rows)"
                )
            # null, where the pre-flight did not know the model (a module built in code): flat packed rows
            logging.getLogger("lit_ppo").info("shared prefix: off, %s (ppo.shared_prefix=null)", reason)
            layout = dataclasses.replace(plan.layout, shared_prefix=False)
            self.plan = plan = dataclasses.replace(plan, layout=layout)
        self.one_row = one_row(attention)  # packed micro-batches in one row (varlen kernels, flex), else balanced rows
        # flex attention: every packed row padded to the plan's budget, the shape its kernel is compiled for
        self.row_tokens = (
            (plan.layout.row_tokens or plan.layout.max_micro_batch_tokens) if fixed_row(attention) else None
        )
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
        self.rank_balance_stats: dict[str, float] = {}  # of the last rollout step (plan.layout.rank_balance)

    # ------------------------------------------------------------ sharding (FSDP2)

    def configure_model(self) -> None:
        """Under ModelParallelStrategy: FSDP2 on each model. Other strategies have no device mesh and keep whole models."""
        if self.device_mesh is None or self.sharded:
            return
        shard_models(
            (
                self.actor,
                self.critic,
                self.reference,
                self.teacher if isinstance(self.teacher, torch.nn.Module) else None,
            ),
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

    # ------------------------------------------------------------ forwards

    @property
    def context(self) -> ContextGroup | None:
        """The context-parallel group running each forward with this rank (training/context_parallel.py), or None."""
        return ContextGroup.of(self.topology) if self.topology.context_parallel_group is not None else None

    def response_logprobs(self, model, mb: MicroBatch) -> Tensor:
        """In float32 chunks (lit_ppo.training.logits): never a float32 copy of the whole [B, T, V]."""
        return logprobs_and_entropy(model, mb, self.temperature, self.context)[0]

    def reference_logprobs(self, mb: MicroBatch) -> Tensor:
        """The reference model's log-probs: with LoRA the actor with its adapter disabled (the frozen base), no copy."""
        if self.lora:
            with adapter_disabled(self.actor):
                return self.response_logprobs(self.actor, mb)
        return self.response_logprobs(self.reference, mb)

    def micro_batch_layout(self, batch: RolloutBatch) -> MicroBatchLayout:
        """How this rank lays out `batch`'s samples in micro-batches, for one pass over it."""
        return MicroBatchLayout(
            batch, self.ppo, self.plan, self.pad_token_id, self.device, self.one_row, self.row_tokens
        )

    @torch.no_grad()
    def check_packed_layout(self, batch: RolloutBatch) -> None:
        """The start-up check of ppo.packing (`packing_check.check_packing`): the first micro-batch's first samples,
        packed as the run lays them out, against each one's padded forward alone; every rank checks as many samples
        (under FSDP each forward is a collective); C > 1: through the context-parallel forwards."""
        layout = self.micro_batch_layout(batch)
        [(idx, packed)] = layout.lay_out(layout.split(list(range(len(batch.response_ids))))[:1])
        count = min(CHECKED_SAMPLES, len(idx))
        count = -int(global_max(torch.tensor(-float(count), device=self.device)))  # the fewest of any rank
        alone = [
            mb for _, mb in packed_micro_batches(batch, [[i] for i in idx[:count]], self.pad_token_id, self.device)
        ]
        check_packing(
            self.actor, self.critic, packed, alone, self.temperature, self.plan.models.precision, self.context
        )
        self.packing_checked = True

    # ------------------------------------------------------------ experience

    @torch.no_grad()
    def make_experience(self, batch: RolloutBatch) -> Experience:
        """Old log-probs, reference (and teacher) log-probs and values (once per rollout step), then advantages."""
        N = len(batch.response_ids)
        T = max(1, max(len(r) for r in batch.response_ids))

        # float32 whatever the default dtype: under bf16-true Lightning makes bf16 the default here
        def zeros() -> Tensor:
            return torch.zeros(N, T, device=self.device, dtype=torch.float32)

        # The actor's forward only when the old log-probs come from it (StepPlan.old_logprobs.source): an exactly
        # on-policy update takes them from its own training forwards, ppo.old_logprobs=rollout from vLLM.
        source = self.plan.old_logprobs.source
        if source == "vLLM" and batch.rollout_logprobs is None:
            raise ConfigError(
                "ppo.old_logprobs=rollout takes vLLM's sampling log-probs as the old ones, but this rollout "
                "batch has none (not generated by vLLM); fix: set ppo.old_logprobs=auto"
            )
        mask = zeros()
        old_logp = zeros() if source == "experience forward" else None
        ref_logp = zeros() if self.plan.models.reference_enabled else None
        values = zeros() if self.critic is not None else None
        # A server teacher asked once, by a context-parallel group's rank 0 (None in process or after a signal).
        teacher_logp = server_teacher_logprobs(self.teacher, batch, T, self.device, self.topology)
        preemption.stop_point(self.device)
        in_process_teacher = self.teacher is not None and teacher_logp is None
        teacher_logp = zeros() if in_process_teacher else teacher_logp

        # Before the interruptible region: with a token budget under data parallelism the split all-reduces the ranks'
        # micro-batch counts, and a collective that a signal interrupts on one rank leaves the others waiting in it.
        layout = self.micro_batch_layout(batch)
        groups = layout.split(list(range(N)))

        def forwards(cp=self.context) -> None:
            for idx, mb in layout.lay_out(groups):
                t = mb.response_ids.shape[1]
                mask[idx, :t] = mb.response_mask
                if old_logp is not None:
                    old_logp[idx, :t] = self.response_logprobs(self.actor, mb)
                if ref_logp is not None:
                    ref_logp[idx, :t] = self.reference_logprobs(mb)
                if values is not None:  # zero off the response mask (padding, observations)
                    values[idx, :t] = values_of(self.critic, mb, cp) * mb.response_mask
                if in_process_teacher:
                    teacher_logp[idx, :t] = teacher_logprobs(self.teacher, mb, self.plan.teacher.temperature, cp)

        # Nothing kept yet: a preemption signal drops these forwards and the step (lit_ppo.preemption). Not under
        # FSDP or context parallelism, whose forwards are collectives: interrupted on one rank, the others would wait.
        if self.sharded or self.context is not None:
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
            teacher_logp=teacher_logp,
        )
        if os.environ.get(DUMP_ADVANTAGES_ENV) and self.topology.context_parallel_rank == 0:  # one file per group
            dump_experience(
                Path(os.environ[DUMP_ADVANTAGES_ENV]),
                batch,
                exp,
                self.topology.data_parallel_rank,
                self.plan.counts.data_parallel_size,
            )
        return exp

    def mismatch_bound(self, batch: RolloutBatch) -> float | None:
        """rollout.max_logprob_abs_diff for this batch: the trainer's old log-probs against vLLM's catch a failed
        weight sync only when both are of the same policy version. A stale batch (rollout.max_staleness > 0) differs
        by what k updates changed, which is logged (rollout/logprob_abs_diff) and corrected, not a failure; its
        version's weights were checked where they arrived (the rollout workers' probe, lit_ppo/rollout/workers/worker_main.py).
        Partial rollouts: bounded on the tokens of the step's own version (`experience.current_version_tokens`)."""
        stale = batch.policy_versions is not None and any(v != batch.rollout_step for v in batch.policy_versions)
        stale = stale and batch.version_spans is None
        return None if stale else self.max_logprob_abs_diff

    # ------------------------------------------------------------ PPO updates

    def train_on_experience(self, batch: RolloutBatch, exp: Experience) -> tuple[dict[str, float], Experience]:
        """`ppo_epochs` passes over the rollout step's global batch, one optimizer step per global mini-batch of
        train_batch_size samples, of which this rank trains its share (`rank_share`): the mini-batches are the same
        sets of samples on any number of ranks, so the update is one process's. Returns the updates' mean metrics and
        the experience, with the old log-probs of the training forwards where the plan takes them there."""
        # Every rank's samples and experience, in one process's order: the mini-batches are drawn from them.
        full, picks, own = global_batch(batch, self.topology.data_parallel_rank)
        full_exp = global_experience(exp, picks, self.topology)
        layout = self.micro_batch_layout(full)
        models = [m for m in (self.actor, self.critic) if m is not None]
        N = len(full.response_ids)
        use_counts = torch.zeros(self.plan.counts.ppo_epochs, N, dtype=torch.long)  # [ppo_epochs, N]
        per_update = MeanOver("optimizer update")
        # Without an experience forward, the log-probs of the forwards before the first optimizer step (all of them
        # when on-policy) are the actor's before the update: kept for the old log-probs, the KL and the vLLM check.
        capture = OldLogprobCapture(full_exp.mask) if self.plan.old_logprobs.source != "experience forward" else None
        first = FirstMiniBatchRatio(self.plan.old_logprobs.source)  # its ratio exactly 1: old log-probs its own
        for epoch, minibatches in enumerate(minibatch_schedule(self.plan, N, self.shuffle_generator)):
            for minibatch in minibatches:
                indices = rank_share(full, minibatch, self.plan, self.topology.data_parallel_rank)
                use_counts[epoch, indices] += 1
                denominators = loss_denominators(full_exp, minibatch)  # the global mini-batch's
                for idx, mb, last in layout.mini_batch(indices, self.rollout_step):
                    # The optimizer steps change the models: the step is dropped on preemption only if its start
                    # is on disk; otherwise it finishes and the run stops after it.
                    preemption.stop_point(self.device, module=self)
                    inputs = first.inputs(LossInputs.of(full_exp, idx, mb, denominators, self.ppo))
                    with gradient_sync(last, self.trainer.strategy.model, models, self.sharded):
                        shares, logp = self.actor_backward(mb, inputs)
                        first.add(logp, inputs)
                        per_update.add(shares)
                        if capture is not None:
                            capture.add(idx, logp)
                        if self.critic is not None:  # the update's value loss, one micro-batch's share at a time
                            per_update.add({"critic/value_loss": self.critic_backward(mb, inputs)})
                per_update.add(self.optimizer_steps())
                per_update.count()
                first.close()
                if capture is not None:
                    capture.close()  # the forwards from here on are of the updated actor
        # Over the ranks: each sample's uses (each rank counted its own), checked against the plan by training_step.
        self.last_sample_use_counts = global_sum(use_counts.to(self.device)).cpu()
        if capture is not None:
            exp = capture.experience(exp, own, batch, self.ppo, self.mismatch_bound(batch))
        metrics = update_metrics(
            per_update,
            *layout.counts,
            device=self.device,
            global_sum=global_sum,
            prefix_tokens_saved=layout.prefix_tokens_saved,
        )
        _, schedulers = self.optimizers_and_schedulers()
        metrics.update({f"{name}/lr": s.get_last_lr()[0] for name, s in zip(("actor", "critic"), schedulers)})
        metrics.update(first.metrics(global_max, self.device))
        return metrics, exp

    def actor_backward(self, mb: MicroBatch, inputs: LossInputs) -> tuple[dict[str, float], Tensor]:
        """One micro-batch's share of the actor loss, backpropagated; its shares of the mini-batch's actor statistics
        (`actor_loss_shares`) and its log-probs (detached)."""
        # Float32 chunks; entropy's gradient only when the loss uses it. The logits ([n, V] packed, [B, T + 1, V]
        # padded) are not kept here: autograd frees them (their gradient written over them) once the LM head's
        # backward has read them.
        logp, entropy = logprobs_and_entropy(self.actor, mb, self.temperature, self.context)
        loss, shares = actor_loss(
            logp, entropy, inputs, self.ppo, kl_coef=self.kl_coef, max_len=self.plan.counts.max_response_tokens
        )
        # DDP averages gradients over every rank; the C ranks of a context-parallel group hold parts of the same
        # samples' tokens, and their parts of the gradient add up (lit_ppo/training/context_parallel.py)
        self.manual_backward(loss * self.plan.counts.ranks)
        return shares, logp.detach()

    def critic_backward(self, mb: MicroBatch, inputs: LossInputs) -> float:
        """One micro-batch's share of the value loss, backpropagated (times ppo.value_loss_coef); returns the share."""
        world = self.plan.counts.ranks  # DDP averages gradients over ranks (`actor_backward`)
        loss = critic_loss(values_of(self.critic, mb, self.context), inputs, self.ppo) * world
        self.manual_backward(self.ppo.value_loss_coef * loss)
        return float(loss.detach()) / world

    # ------------------------------------------------------------ the rollout step

    def on_train_start(self) -> None:
        # A resumed run restored the checkpoint's optimizer and schedule states, with their learning rates: this run's
        # (a changed ppo.actor_lr or ppo.critic_lr, the fix NonFiniteUpdatesError names) from here on.
        optimizers, schedulers = self.optimizers_and_schedulers()
        apply_learning_rates(
            [getattr(o, "optimizer", o) for o in optimizers], schedulers, [self.ppo.actor_lr, self.ppo.critic_lr]
        )
        # The engine may hold other weights (a resumed run, a shared engine): start from the actor's.
        engine = self.trainer.datamodule.start_engine()
        device_peak_memory_gib(self.device)  # each rollout step's peak starts here: loading is not counted
        waits.entering("the weight sync before rollout step 1")
        self.sync_weights(engine, self.rollout_step)
        if not self.eval_history:
            waits.entering("the evaluation before rollout step 1")
            self._log_initial_evaluation(self._evaluate())
        elif self.evaluation_missing():  # a run stopped during it: its step's row was kept unlogged until now
            self._evaluate_after_step()
            self._log_row(self.history[-1])

    def training_step(self, dataloader_iter):
        # 1. The rollout batch: the data module generates it with the current weights and scores it.
        waits.entering(f"rollout step {self.rollout_step + 1}'s generation and rewards")
        batch, _, _ = next(dataloader_iter)  # C > 1: the context-parallel group's rank 0's, broadcast
        waits.entering(f"rollout step {batch.rollout_step + 1}'s experience and updates")
        # The proof of the generation schedule: every sample (partial rollouts: token) of the version the plan states.
        check_batch_versions(self.plan, batch)
        engine = self.trainer.datamodule.engine
        check_adapter_versions(batch, self.plan)
        engine.sleep()  # frees vLLM's memory for the updates
        started = time.perf_counter()
        # Packed under data parallelism: the ranks' prompt groups split again by real tokens (after the engine's
        # sleep: under NCCL the all-gather's buffers are on the device; timed with the experience).
        self.rank_balance_stats = {}
        if self.plan.layout.rank_balance:
            batch, self.rank_balance_stats = balanced_rank_batch(batch, self.plan, self.topology.data_parallel_rank)
        # The episodes' ids and policy masks, as this rank will lay them out, before any forward: every rank stops
        # together on a mismatch, so that the exception checkpoint's collectives meet.
        check_rollout_ids(batch)
        if self.plan.layout.packing and not self.packing_checked:  # once per process: a resumed run checks again
            self.check_packed_layout(batch)
        # 2. Experience: old log-probs, reference log-probs, values and advantages, once.
        exp = self.make_experience(batch)
        experience_seconds, started = time.perf_counter() - started, time.perf_counter()
        # 3. The PPO updates, and 4. the check that they took the optimizer steps the plan says.
        actor_before, critic_before = self.actor_optimizer_steps, self.critic_optimizer_steps
        train_metrics, exp = self.train_on_experience(batch, exp)
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
        self.samples_seen += self.plan.counts.samples_per_rollout_step
        self.kl_coef = next_kl_coef(self.kl_coef, exp, self.ppo, self.plan.counts.samples_per_rollout_step)
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
        row = self._rollout_step_row(batch, exp, train_metrics, timings)
        row["actor/skipped_updates"] = self.skipped_updates
        self.history.append(row)  # the step is complete: a checkpoint from here on holds it (metrics.csv: MetricsCSV)
        if self.evaluation_due():
            # A signal during it drops its results and saves this step; the resumed run evaluates, then logs the row.
            self._evaluate_after_step()
        self._log_row(row)

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
            **teacher_metrics(exp),
            **({"rollout/kl_coef": self.kl_coef} if self.plan.models.reference_enabled else {}),
            "perf/weight_sync_bytes": float(self.last_sync_bytes),
            **batch.partial_stats,  # partial rollouts: the whole batch's, the same on every rank
        }
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
        return row
