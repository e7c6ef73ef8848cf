"""Dynamic sampling with refill (DAPO): uniform groups are dropped, more prompts are generated, the optimizer steps
per rollout step stay as planned, the data position advances by what was drawn, and a resumed run is exact."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_ppo.checkpoints import checkpoint_path
from lit_ppo.config import DynamicSamplingConfig, PPOConfig
from lit_ppo.errors import ConfigError, DynamicSamplingShortfallError
from tests.helpers import plan_of
from tests.helpers.asynchronous import even_answers_are_uniform
from tests.helpers.resume import assert_same_weights, checkpointed_run

ROLLOUT_BATCH = 8  # prompts per rollout step (and per generation round)


def trl_reward_none_for_multiples_of_3(prompts, completions, answer, **kwargs):
    """A TRL-style reward: None ("does not apply") for every sample of a prompt whose answer is a multiple of 3,
    otherwise `even_answers_are_uniform`'s score."""
    scores = even_answers_are_uniform(prompts, completions, answer, [{}] * len(completions))
    return [None if int(a) % 3 == 0 else s for s, a in zip(scores, answer)]


def run(
    paths,
    engine,
    tmp_path,
    *,
    steps=4,
    rounds=3,
    on_shortfall="fill",
    callbacks=(),
    resume_from=None,
    crash_after=None,
    reward_fn=even_answers_are_uniform,
):
    batches = []

    class RecordBatches(L.Callback):  # each rollout batch the data module produces, in order
        def setup(self, trainer, module, stage):
            produce = trainer.datamodule.produce_rollout
            trainer.datamodule.produce_rollout = lambda step: batches.append(produce(step)) or batches[-1]

    _, module, datamodule = checkpointed_run(
        paths,
        engine,
        tmp_path,
        every=1,
        keep=10,
        callbacks=[*callbacks, RecordBatches()],
        crash_after=crash_after,
        resume_from=resume_from,
        total_rollout_steps=steps,
        reward_fn=reward_fn,
        advantage_estimator="grpo",
        kl_coef=0.0,
        kl_mode="loss",
        rollout_batch_size=ROLLOUT_BATCH,
        dynamic_sampling=DynamicSamplingConfig(enabled=True, max_generation_rounds=rounds, on_shortfall=on_shortfall),
    )
    return module, datamodule, module.plan, batches


@pytest.fixture(scope="module")
def paths(tiny_model_dir, arithmetic_files):
    return tiny_model_dir, arithmetic_files


@pytest.fixture(scope="module")
def full_run(paths, engine, tmp_path_factory):
    """5 uninterrupted rollout steps; they draw more than the 8 rounds of a data epoch."""
    return run(paths, engine, tmp_path_factory.mktemp("full"), steps=5)


def test_refill_keeps_the_planned_optimizer_steps_and_counts_what_it_drew(full_run):
    module, datamodule, plan, batches = full_run
    answers = [int(p.reference) for p in datamodule.train_prompts.prompts]
    # 8 prompts x 4 samples / 8 per update = 4 optimizer steps per rollout step, whatever the rounds drawn.
    assert plan.counts.optimizer_steps_per_rollout_step == 4
    assert module.actor_optimizer_steps == 5 * 4
    first_round = 0
    for row, batch in zip(module.history, batches):
        rounds = row["rollout/generation_rounds"]
        assert row["rollout/prompts_consumed"] == batch.prompts_consumed == rounds * ROLLOUT_BATCH
        drawn = [i for r in range(first_round, first_round + rounds) for i in datamodule.round_prompt_indices(r)]
        first_round += rounds
        # Every even-answer group drawn is dropped; odd-answer groups differ (their responses do).
        assert row["rollout/dropped_groups"] == sum(answers[i] % 2 == 0 for i in drawn)
        # The batch: whole groups, 8 prompts, odd answers first in the order drawn, then the filled-in uniform ones.
        trained = batch.dataset_indices[::4]
        assert len(trained) == ROLLOUT_BATCH and len(batch.response_ids) == ROLLOUT_BATCH * 4
        informative = [i for i in drawn if answers[i] % 2]
        assert trained == (informative + [i for i in drawn if answers[i] % 2 == 0])[:ROLLOUT_BATCH]
        assert row["rollout/filled_groups"] == max(0, ROLLOUT_BATCH - len(informative))
    # The data position moved by the rounds drawn; rounds > 1 happened (the refill), and so did a data epoch.
    assert (
        datamodule.stream.next_generation_round
        == first_round
        == sum(r["rollout/generation_rounds"] for r in module.history)
    )
    assert max(r["rollout/generation_rounds"] for r in module.history) > 1
    assert first_round > plan.counts.generation_rounds_per_data_epoch == 8


def test_reward_counts_are_summed_over_every_round(paths, engine, tmp_path):
    """rollout/reward_none (and the other scorer counts: errors, timeouts) count the samples of every generation
    round of the step, the dropped groups' included; they used to vanish under dynamic sampling."""
    module, datamodule, _, _ = run(paths, engine, tmp_path, steps=2, reward_fn=trl_reward_none_for_multiples_of_3)
    answers = [int(p.reference) for p in datamodule.train_prompts.prompts]
    first_round = 0
    for row in module.history:
        rounds = row["rollout/generation_rounds"]
        drawn = [i for r in range(first_round, first_round + rounds) for i in datamodule.round_prompt_indices(r)]
        first_round += rounds
        assert row["rollout/reward_none"] == 4 * sum(answers[i] % 3 == 0 for i in drawn) > 0  # 4 samples a prompt
        assert row["rollout/reward_errors"] == row["rollout/reward_timeouts"] == 0


def test_resume_mid_run_matches_an_uninterrupted_run(paths, engine, full_run, tmp_path):
    # The resumed part (rollout steps 4 and 5) crosses into the second data epoch.
    full, full_dm, plan, _ = full_run
    run(paths, engine, tmp_path / "split", steps=5, crash_after=4)
    resumed, resumed_dm, _, _ = run(
        paths,
        engine,
        tmp_path / "split",
        steps=5,
        resume_from=str(checkpoint_path(tmp_path / "split" / "checkpoints", 3)),
    )
    assert (
        resumed_dm.stream.next_generation_round
        == full_dm.stream.next_generation_round
        > plan.counts.generation_rounds_per_data_epoch
    )
    assert resumed.actor_optimizer_steps == full.actor_optimizer_steps == 20
    assert_same_weights(resumed.actor.state_dict(), full.actor.state_dict())
    keys = ("rollout/reward_mean", "rollout/generation_rounds", "rollout/prompts_consumed", "rollout/dropped_groups")
    assert [[r[k] for k in keys] for r in resumed.history] == [[r[k] for k in keys] for r in full.history]


def test_on_shortfall_stop_ends_with_a_checkpoint_to_resume_from_with_on_shortfall_fill(paths, engine, tmp_path):
    # One round of 8 prompts holds fewer than 8 odd answers: stop.
    with pytest.raises(DynamicSamplingShortfallError, match="on_shortfall=fill"):
        run(paths, engine, tmp_path, steps=2, rounds=1, on_shortfall="stop")
    saved = torch.load(checkpoint_path(tmp_path / "checkpoints", 0), weights_only=False)
    state = next(v for k, v in saved.items() if "RolloutDataModule" in k)
    assert state == {"next_rollout_step": 0, "next_generation_round": 0}  # the failed step is retried on resume
    # The fix the error names, on resume (a key that may change then): the run ends with the planned counts.
    module, _, plan, batches = run(
        paths, engine, tmp_path, steps=2, rounds=1, resume_from=checkpoint_path(tmp_path / "checkpoints", 0)
    )
    assert [b.rollout_step for b in batches] == [0, 1] and batches[0].generation_rounds == 1
    assert module.rollout_step == 2
    assert module.actor_optimizer_steps == 2 * plan.counts.optimizer_steps_per_rollout_step


def test_plan_states_the_rounds_and_refuses_data_epochs():
    ppo = PPOConfig(
        rollout_batch_size=8,
        train_batch_size=8,
        micro_train_batch_size=4,
        advantage_estimator="grpo",
        kl_mode="loss",
        dynamic_sampling=DynamicSamplingConfig(enabled=True, max_generation_rounds=3, prompts_per_round=16),
    )
    plan = plan_of(100, ppo=ppo, steps=5)
    assert (
        plan.counts.prompts_per_generation_round,
        plan.dynamic_sampling.max_generation_rounds,
        plan.counts.generation_rounds_per_data_epoch,
    ) == (
        16,
        3,
        6,
    )
    assert plan.counts.optimizer_steps_per_rollout_step == 4
    assert "rounds of 16 prompts (3 at most)" in plan.table() and "stay 4" in plan.table()
    with pytest.raises(ConfigError, match="trainer.total_rollout_steps"):
        plan_of(100, ppo=ppo, steps=None, data_epochs=1.0)
