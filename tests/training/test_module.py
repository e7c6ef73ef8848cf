"""The PPO loop on the real Lightning trainer and the real vLLM engine."""

from __future__ import annotations

import pytest
import torch

from lit_ppo.errors import StepAccountingError
from lit_ppo.plan import minibatch_schedule
from lit_ppo.training import module as module_file
from tests.helpers import build_run


@pytest.mark.parametrize("ppo_epochs", [1, 2, 4])
def test_ppo_epochs_and_batch_sizes_take_effect(tiny_model_dir, engine, arithmetic_files, tmp_path, ppo_epochs):
    # 8 prompts x 4 samples = 32 samples per rollout step; train batch 8 -> 4 mini-batches per epoch.
    trainer, module, datamodule, plan = build_run(
        tiny_model_dir, engine, arithmetic_files, tmp_path, total_rollout_steps=2, ppo_epochs=ppo_epochs
    )
    expected_per_rollout_step = 8 * 4 * ppo_epochs // 8
    assert plan.counts.optimizer_steps_per_rollout_step == expected_per_rollout_step
    assert plan.layout.grad_accumulation_steps == 2
    trainer.fit(module, datamodule=datamodule)
    assert module.rollout_step == 2
    assert module.actor_optimizer_steps == 2 * expected_per_rollout_step
    assert module.critic_optimizer_steps == 2 * expected_per_rollout_step
    # Every sample of the last rollout batch was used exactly once in each PPO epoch.
    assert module.last_sample_use_counts.shape == (ppo_epochs, 32)
    assert torch.equal(module.last_sample_use_counts, torch.ones(ppo_epochs, 32, dtype=torch.long))
    # The LR schedulers stepped once per optimizer step, as the plan says.
    actor_sched = module.lr_schedulers()[0]
    assert actor_sched.last_epoch == plan.counts.total_optimizer_steps


def test_minibatch_order_is_reshuffled_every_epoch(tiny_model_dir, engine, arithmetic_files, tmp_path):
    _, module, _, _ = build_run(tiny_model_dir, engine, arithmetic_files, tmp_path, ppo_epochs=3)
    schedule = minibatch_schedule(module.plan, 32, module.shuffle_generator)
    orders = [sum(epoch, []) for epoch in schedule]
    assert all(sorted(order) == list(range(32)) for order in orders)
    assert len({tuple(order) for order in orders}) == 3  # every pair of epochs differs, 0 and 2 included


def test_broken_epoch_loop_is_caught(tiny_model_dir, engine, arithmetic_files, tmp_path, monkeypatch):
    """The verl bug: an update loop that silently runs one PPO epoch instead of ppo_epochs."""
    trainer, module, datamodule, _ = build_run(tiny_model_dir, engine, arithmetic_files, tmp_path, ppo_epochs=2)
    original = module_file.minibatch_schedule
    monkeypatch.setattr(module_file, "minibatch_schedule", lambda plan, n, generator: original(plan, n, generator)[:1])
    with pytest.raises(StepAccountingError, match="the plan says 8 each"):
        trainer.fit(module, datamodule=datamodule)


def test_critic_and_reference_only_when_needed(tiny_model_dir, engine, arithmetic_files, tmp_path):
    _, grpo, _, _ = build_run(
        tiny_model_dir, engine, arithmetic_files, tmp_path, advantage_estimator="grpo", kl_coef=0.0
    )
    assert grpo.critic is None and grpo.reference is None
    assert len(grpo.configure_optimizers()[0]) == 1
    _, ppo, _, _ = build_run(
        tiny_model_dir, engine, arithmetic_files, tmp_path, advantage_estimator="gae", kl_coef=0.05
    )
    assert ppo.critic is not None and ppo.reference is not None
    assert not any(p.requires_grad for p in ppo.reference.parameters())


def test_weight_sync_makes_vllm_match_the_actor(tiny_model_dir, engine, arithmetic_files, tmp_path):
    """After an update, vLLM's log-probs of a fixed response equal the actor's (1e-3) and have changed."""
    from lit_ppo.training.batching import pack

    # A reward that varies between samples, so the random policy gets a learning signal.
    trainer, module, datamodule, _ = build_run(
        tiny_model_dir,
        engine,
        arithmetic_files,
        tmp_path,
        actor_lr=5e-3,
        reward_fn=lambda p, responses, r, e: [len(x) % 3 for x in responses],
    )
    prompt = datamodule.train_prompts.prompts[0].prompt_ids
    response = datamodule.tokenizer("123", add_special_tokens=False).input_ids + [datamodule.tokenizer.eos_token_id]

    def actor_logprobs():
        mb = pack([prompt], [response], module.pad_token_id, module.device)
        with torch.no_grad():
            return module.response_logprobs(module.actor, mb)[0]

    module.sync_weights(engine)
    before_vllm = torch.tensor(engine.sequence_logprobs(prompt, response))
    assert torch.allclose(before_vllm, actor_logprobs(), atol=1e-3)
    trainer.fit(module, datamodule=datamodule)  # one rollout step: updates, then the in-place sync
    assert module.actor_optimizer_steps > 0
    after_vllm = torch.tensor(engine.sequence_logprobs(prompt, response))
    after_actor = actor_logprobs()
    assert torch.allclose(after_vllm, after_actor, atol=1e-3), (after_vllm, after_actor)
    assert (after_vllm - before_vllm).abs().max() > 1e-2


def test_warm_start_cache_is_keyed_on_what_the_warm_start_reads(tmp_path):
    """The 1,500-step warm start is redone only when what it reads changes (its settings, the seed, the training
    records, the base model): not for data.n_eval, which changes only the held-out prompts."""
    from lit_ppo.run.train import prepare_data, prepare_model
    from tests.helpers import compose_run_config

    def warm_dir(*overrides: str) -> str:
        cfg = compose_run_config(
            f"cache_dir={tmp_path / 'cache'}",
            "model.warm_start.steps=2",
            "model.warm_start.batch_size=4",
            "model.tiny.hidden_size=32",
            "model.tiny.num_layers=1",
            "model.tiny.intermediate_size=64",
            *overrides,
        )
        _, _, records = prepare_data(cfg.data, tmp_path / "data", write=False)
        return prepare_model(cfg, records)

    first = warm_dir("data.n_eval=200")
    assert warm_dir("data.n_eval=100") == first  # the same training records: the cached warm start
    assert warm_dir("data.n_eval=100", "data.n_train=1000") != first  # other demonstrations
    assert warm_dir("data.max_operand=60") != first
    assert warm_dir("model.warm_start.teacher_accuracy=0.5") != first
    assert len(list((tmp_path / "cache").glob("warm-*"))) == 4


@pytest.mark.parametrize("preset", ["rloo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo"])
def test_a_preset_trains_a_rollout_step_through_the_module(
    preset, tiny_model_dir, engine, arithmetic_files, tmp_path, monkeypatch
):
    """The presets with no other test that trains them through PPOModule (their estimators and loss aggregations are
    tests/test_algorithms'): the preset's settings (what conf/ppo/<preset>.yaml changes from ppo's) on the small run's
    batch sizes, one rollout step on the shared engine: the planned optimizer steps, no critic, a reference model where
    the preset has a KL, the policy loss aggregated by the preset's loss_agg_mode over the plan's response budget
    (dr_grpo's seq-mean-token-sum-norm divides by it), a finite loss and a gradient."""
    import dataclasses

    from lit_ppo import algorithms
    from tests.helpers import compose_run_config

    ppo, chosen = (dataclasses.asdict(compose_run_config(f"ppo={p}").ppo) for p in ("ppo", preset))
    settings = {k: v for k, v in chosen.items() if v != ppo[k]}
    assert settings["advantage_estimator"] == preset
    aggregated = []  # (mode, max_len) of each aggregation of a per-token loss or statistic
    aggregate_loss = algorithms.aggregate_loss

    def recording(loss, mask, mode, **denominators):
        aggregated.append((mode, denominators.get("max_len")))
        return aggregate_loss(loss, mask, mode, **denominators)

    monkeypatch.setattr(algorithms, "aggregate_loss", recording)
    trainer, module, datamodule, plan = build_run(
        tiny_model_dir,
        engine,
        arithmetic_files,
        tmp_path,
        reward_fn=lambda p, responses, r, e: [float(len(x) % 3) for x in responses],  # rewards that vary in a group
        **settings,
    )
    trainer.fit(module, datamodule=datamodule)
    assert module.rollout_step == 1 and module.critic is None
    assert (module.reference is not None) == (chosen["kl_coef"] > 0)
    assert module.actor_optimizer_steps == plan.counts.total_optimizer_steps == 4  # 32 samples / 8 per update
    assert module.critic_optimizer_steps == 0
    # 4 updates of 2 micro-batches: each micro-batch's policy loss (and its actor/policy_loss share) aggregated by the
    # preset's mode, every aggregation over the plan's 6-token budget
    assert [mode for mode, _ in aggregated].count(chosen["loss_agg_mode"]) >= 8 * 2, aggregated
    assert {max_len for _, max_len in aggregated} == {plan.counts.max_response_tokens} == {6}
    row = module.history[-1]
    assert torch.isfinite(torch.tensor(row["actor/policy_loss"])) and row["actor/grad_norm"] > 0
