"""PPOModule's own state in a checkpoint, beside Lightning's weights, optimizers and schedulers (`module_state`,
`restore_module_state`: `PPOModule.on_save_checkpoint` / `on_load_checkpoint`), and the checks of a checkpoint's plan
against the resumed run's (its models, its adapters, its rollout step's shape); the module's checkpoint hooks
(`CheckpointedModule`, mixed into PPOModule). The checkpoint files themselves and their
rotation are `lit_ppo/checkpoints.py`'s, what a run resumes from `lit_ppo/resume.py`'s.
"""

from __future__ import annotations

from lit_ppo.checkpoints import restore_rng_state, rng_state
from lit_ppo.console import show
from lit_ppo.distributed import EVERY_RANK, all_gather_objects
from lit_ppo.errors import ConfigError, StepAccountingError
from lit_ppo.plan import sections_of


def check_same_models(saved_plan: dict, plan) -> None:
    """The checkpoint's models (actor, critic, reference), as its plan states them, are the ones this run builds:
    another algorithm (a PPO checkpoint, with a critic, resumed with ppo=grpo) is refused in one line, not with a
    state-dict traceback. Read from the plan, not the weights: an FSDP checkpoint's weights are loaded apart."""

    def models(critic: bool, reference: bool) -> list[str]:
        return ["actor"] + ["critic"] * critic + ["reference"] * reference

    saved_models = sections_of(saved_plan)["models"]
    saved = models(saved_models["critic_enabled"], saved_models["reference_enabled"])
    now = models(plan.models.critic_enabled, plan.models.reference_enabled)
    if saved != now:
        raise ConfigError(
            f"the checkpoint holds the models {saved} but this run builds {now} (another algorithm: "
            "a critic or a reference model present in one and not the other); fix: resume with the checkpoint's "
            "ppo settings, or start a new run in another output_dir"
        )


def check_same_adapters(saved_plan: dict, plan) -> None:
    """The checkpoint's LoRA adapters (rank, alpha, target modules, as its plan states them) are the ones this run
    builds. Where the checkpoint's keys cannot be read (FSDP loads them apart, not strictly: the frozen base is not
    in a LoRA checkpoint), a full-parameter checkpoint or other adapters would otherwise leave this run's adapters at
    their initial values without a word."""

    def adapters(lora: dict | None) -> dict:  # None: no adapter (also in a plan written before LoRA existed)
        targets = (lora or {}).get("target_modules", "")
        return {
            "rank": (lora or {}).get("rank", 0),
            "alpha": (lora or {}).get("alpha", 0.0),
            "targets": targets if isinstance(targets, str) else sorted(targets),
        }

    saved, now = adapters(sections_of(saved_plan)["lora"]), adapters(plan.to_dict()["lora"])
    if saved != now:
        raise ConfigError(
            f"the checkpoint was written with the adapters {saved} but this run trains {now}; fix: resume with the "
            "model.lora settings it was written with, or start a new run in another output_dir"
        )


def check_same_rollout_step_shape(saved_plan: dict, plan) -> None:
    """A resumed run may be longer or shorter, but each rollout step must keep its shape."""
    saved_counts = sections_of(saved_plan)["counts"]
    planned = {k: saved_counts[k] for k in ("optimizer_steps_per_rollout_step", "samples_per_rollout_step")}
    now = {k: getattr(plan.counts, k) for k in planned}
    if planned != now:
        raise StepAccountingError(
            f"the checkpoint was written under another plan {planned}, this run plans {now}; "
            "fix: resume with the same ppo batch sizes and ppo_epochs"
        )


MODULE_STATE = (
    "rollout_step",
    "actor_optimizer_steps",
    "critic_optimizer_steps",
    "samples_seen",
    "kl_coef",
    "history",
    "eval_history",
)
"""PPOModule's attributes that a checkpoint holds (`module_state`)."""


def rank_states(module) -> list[dict]:
    """Every rank's own random streams (the global ones and the mini-batch shuffle's), in rank order. A collective
    (every rank saves the checkpoint together); rank 0 writes them all into the one file."""
    own = {"rng": rng_state(), "shuffle_generator": module.shuffle_generator.get_state()}
    return all_gather_objects(own, group=EVERY_RANK)


def module_state(module) -> dict:
    """PPOModule's own state, checkpointed beside Lightning's (weights, optimizers, schedulers): its counters and
    histories (MODULE_STATE), the skipped updates, the mini-batch shuffle's and the global random streams (rank 0's,
    and every rank's in `rank_states`), and the plan, against which a resumed run is checked."""
    return {
        **{k: getattr(module, k) for k in MODULE_STATE},
        "skipped_updates": module.guarded_step.skipped,
        "shuffle_generator": module.shuffle_generator.get_state(),
        "rng": rng_state(),
        "rank_states": rank_states(module),
        "plan": module.plan.to_dict(),
    }


def restore_module_state(module, state: dict) -> None:
    """The inverse of `module_state`, on a module built for the resumed run, on any number of ranks and any
    context-parallel size C: on the ranks and C that wrote the checkpoint each rank takes back its own random streams;
    on others, every rank takes rank 0's (a rank's streams then cannot be the ones an uninterrupted run would have had:
    its share of the data differs)."""
    for k in MODULE_STATE:
        setattr(module, k, state[k])
    module.guarded_step.skipped = state["skipped_updates"]
    saved = state.get("rank_states") or []  # absent in checkpoints written before they were kept
    rank, world = module.topology.rank, module.topology.world_size
    counts, C = sections_of(state["plan"])["counts"], module.plan.counts.context_parallel_size
    saved_C = counts.get("context_parallel_size", 1)  # absent in plans written before issue 51
    saved_ranks = counts["data_parallel_size"] * saved_C
    same_ranks = (saved_ranks, saved_C) == (world, C)
    own = saved[rank] if same_ranks and len(saved) == world else {k: state[k] for k in ("rng", "shuffle_generator")}
    module.shuffle_generator.set_state(own["shuffle_generator"])
    restore_rng_state(own["rng"])
    check_same_rollout_step_shape(state["plan"], module.plan)
    if not same_ranks and module.topology.is_rank_zero:
        groups = (f" (C = {saved_C})", f" (C = {C})") if max(saved_C, C) > 1 else ("", "")
        show(
            f"resharded: the checkpoint of rollout step {state['rollout_step']} was written by {saved_ranks} "
            f"rank(s){groups[0]} and continues on {world}{groups[1]}; weights and optimizer states are whole, the data "
            "position and the sampling seeds global; each rank takes rank 0's random streams"
        )


class CheckpointedModule:
    """What PPOModule writes into a checkpoint and checks on loading one (a mixin: a checkpoint holds the trained
    tensors only, and the module's own state beside them, `module_state`)."""

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
