"""Multi-turn episodes through the real vLLM engine and the real trainer (the session's tiny model).

The tiny model has random weights, so it rarely writes a well-formed tool call by itself; the calculator here
treats any turn that starts with a digit as a call (`DigitCallCalculator`), so that episodes of several turns
with observations between them occur in every rollout batch."""

from __future__ import annotations

import pytest
import torch

from lit_ppo.config import EpisodesConfig, RolloutConfig
from lit_ppo.training.batching import pack
from tests.helpers import build_run
from tests.helpers.episodes import ENVIRONMENT


def test_episodes_train_with_exact_ids_and_policy_mask(tiny_model_dir, engine, arithmetic_files, tmp_path):
    rollout = RolloutConfig(
        max_response_tokens=6,
        eval_samples_per_prompt=2,
        episodes=EpisodesConfig(environment=ENVIRONMENT, max_turns=3, max_tokens=30),
    )
    trainer, module, datamodule, plan = build_run(
        tiny_model_dir,
        engine,
        arithmetic_files,
        tmp_path,
        total_rollout_steps=2,
        rollout=rollout,
        advantage_estimator="gae",
    )
    assert (
        plan.episodes.max_episode_tokens == 30
        and plan.counts.max_response_tokens == 30
        and plan.episodes.max_turns == 3
    )
    module.sync_weights(datamodule.start_engine())
    batch = datamodule.produce_rollout(0)
    datamodule.next_rollout_step = 0
    datamodule.stream.next_generation_round = 0
    assert len(batch.response_ids) == 32 and batch.policy_masks is not None and batch.episode_ids is not None
    three_turns = [i for i, m in enumerate(batch.policy_masks) if 0 in m]
    assert three_turns, "no episode with an observation"
    for i in range(32):
        assert len(batch.policy_masks[i]) == len(batch.response_ids[i]) == len(batch.rollout_logprobs[i]) <= 30
        assert batch.episode_ids[i] == batch.prompt_ids[i] + batch.response_ids[i]
    # The trainer's log-probs of the policy tokens are vLLM's (float32): the context it packs is the one sampled in.
    mb = pack(
        batch.prompt_ids,
        batch.response_ids,
        module.pad_token_id,
        "cpu",
        policy_masks=batch.policy_masks,
    )
    with torch.no_grad():
        logp = module.response_logprobs(module.actor, mb)
    vllm = torch.zeros_like(logp)
    for i, lp in enumerate(batch.rollout_logprobs):
        vllm[i, : len(lp)] = torch.tensor(lp)
    assert ((logp - vllm).abs() * mb.response_mask).max() < 1e-3
    assert mb.response_mask.sum() < torch.tensor([len(r) for r in batch.response_ids]).sum()  # observations left out
    trainer.fit(module, datamodule=datamodule)
    row = module.history[-1]
    assert row["rollout/turns_mean"] > 1 and row["rollout/tool_calls"] > 0 and row["rollout/observation_tokens"] > 0
    assert (
        row["rollout/episode_tokens"] >= row["rollout/response_length_mean"] + row["rollout/observation_tokens"] - 1e-9
    )
    assert module.actor_optimizer_steps == 2 * plan.counts.optimizer_steps_per_rollout_step
    assert "eval/tool_call_rate" in module.eval_history[-1]


def test_single_turn_batches_carry_no_episode_fields(tiny_model_dir, engine, arithmetic_files, tmp_path):
    _, module, datamodule, plan = build_run(tiny_model_dir, engine, arithmetic_files, tmp_path)
    module.sync_weights(datamodule.start_engine())
    batch = datamodule.produce_rollout(0)
    assert batch.policy_masks is None and batch.episode_ids is None and batch.episode_stats == {}
    assert plan.episodes is None and plan.counts.max_response_tokens == 6


@pytest.mark.parametrize(
    "spec, match", [({"_target_": "lit_ppo.environments.CalculatorEnvironment", "call_end": "</calc>"}, "not one")]
)
def test_bad_environment_settings_fail_before_training(tiny_model_dir, engine, arithmetic_files, tmp_path, spec, match):
    from lit_ppo.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        build_run(
            tiny_model_dir,
            engine,
            arithmetic_files,
            tmp_path,
            rollout=RolloutConfig(episodes=EpisodesConfig(environment=spec, max_turns=2)),
        )
