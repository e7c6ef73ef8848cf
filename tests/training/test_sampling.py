"""The trainer trains on the distribution vLLM sampled from.

vLLM returns its own log-prob of every sampled token (after temperature and top-p) in the rollout batch;
the trainer's old log-probs must equal them, and a run whose engine stopped following the actor stops."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_ppo.config import PPOConfig, RolloutConfig
from lit_ppo.rollout.prompts import load_prompts
from lit_ppo.training.batching import pack
from tests.helpers import build_run, datamodule_on


def make_datamodule(model_dir, engine, files, rollout: RolloutConfig, **ppo_overrides):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_prompts, eval_prompts = load_prompts(files[0], tokenizer), load_prompts(files[1], tokenizer)
    ppo = PPOConfig(
        **{
            "rollout_batch_size": 8,
            "n_samples_per_prompt": 4,
            "train_batch_size": 16,
            "micro_train_batch_size": 8,
            **ppo_overrides,
        }
    )
    return datamodule_on(train_prompts, rollout, tokenizer, model_dir, engine, ppo=ppo, eval_prompts=eval_prompts)


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_rollout_batch_carries_vllm_logprobs_of_the_sampled_distribution(
    tiny_model_dir, engine, long_prompt_files, temperature
):
    """Each sampled token's vLLM log-prob is log softmax(logits / T) of the model that sampled it (float32, 1e-3)."""
    rollout = RolloutConfig(max_response_tokens=12, temperature=temperature)
    datamodule = make_datamodule(tiny_model_dir, engine, long_prompt_files, rollout)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine.sync_weights(model.state_dict().items())  # other tests may have left the shared engine elsewhere
    batch = datamodule.produce_rollout(0)
    assert min(len(p) for p in batch.prompt_ids) >= 100
    assert [len(lp) for lp in batch.rollout_logprobs] == [len(r) for r in batch.response_ids]
    mb = pack(batch.prompt_ids, batch.response_ids, datamodule.tokenizer.pad_token_id, "cpu")
    T = mb.response_ids.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, logits_to_keep=T + 1
        ).logits[:, :T]
    expected = (logits / temperature).log_softmax(-1).gather(-1, mb.response_ids.unsqueeze(-1)).squeeze(-1)
    for row, logprobs in enumerate(batch.rollout_logprobs):
        assert torch.allclose(torch.tensor(logprobs), expected[row, : len(logprobs)], atol=1e-3), row
    if temperature != 1.0:  # the comparison can fail: the raw distribution is far from the sampled one
        raw = logits.log_softmax(-1).gather(-1, mb.response_ids.unsqueeze(-1)).squeeze(-1)
        mask = mb.response_mask.bool()
        vllm = torch.zeros_like(raw)
        for row, logprobs in enumerate(batch.rollout_logprobs):
            vllm[row, : len(logprobs)] = torch.tensor(logprobs)
        assert (raw - vllm)[mask].abs().mean() > 0.02


# ------------------------------------------------------------------ the trainer's log-probs are the sampler's


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_trainer_old_logprobs_equal_vllm_logprobs(tiny_model_dir, engine, long_prompt_files, tmp_path, temperature):
    """make_experience's old log-probs of the sampled tokens equal vLLM's within 1e-3 per token (float32), at a
    temperature other than 1 too; the logged mean difference says so."""
    rollout = RolloutConfig(max_response_tokens=12, temperature=temperature)
    _, module, datamodule, _ = build_run(
        tiny_model_dir,
        engine,
        long_prompt_files,
        tmp_path,
        rollout=rollout,
        train_batch_size=16,
        micro_train_batch_size=8,
    )
    module.sync_weights(engine)
    batch = datamodule.produce_rollout(0)
    exp = module.make_experience(batch)
    mask = exp.mask.bool()
    assert min(len(p) for p in batch.prompt_ids) >= 100 and int(mask.sum()) > 100
    diff = (exp.old_logp - exp.rollout_logp)[mask].abs()
    assert float(diff.max()) < 1e-3, float(diff.max())
    assert float(exp.logprob_abs_diff_mean) == pytest.approx(float(diff.mean()), abs=1e-9)
    assert float(exp.logprob_abs_diff_max) == pytest.approx(float(diff.max()), abs=1e-9)


def test_an_engine_left_with_stale_weights_stops_the_run(
    tiny_model_dir, engine, arithmetic_files, tmp_path, monkeypatch
):
    """After an update at a high learning rate the engine is NOT given the new weights: the next rollout step's
    samples come from the old policy, and the gate stops the run naming that rollout step."""
    from lit_ppo.errors import RolloutMismatchError

    varied = lambda p, responses, r, e: [len(x) % 3 for x in responses]  # noqa: E731 - a learning signal
    trainer, module, datamodule, _ = build_run(
        tiny_model_dir, engine, arithmetic_files, tmp_path, total_rollout_steps=3, actor_lr=5e-2, reward_fn=varied
    )
    synced = []
    real_sync = type(module).sync_weights

    def sync_only_at_the_start(self, engine_, *args, **kwargs):
        if not synced:
            real_sync(self, engine_, *args, **kwargs)
        synced.append(self.rollout_step)

    monkeypatch.setattr(type(module), "sync_weights", sync_only_at_the_start)
    with pytest.raises(RolloutMismatchError, match=r"^rollout step 2: .*max_logprob_abs_diff=0.5") as info:
        trainer.fit(module, datamodule=datamodule)
    assert "\n" not in str(info.value)
    assert module.history[0]["rollout/logprob_abs_diff"] < 1e-3  # step 1 sampled from the synced weights


def test_kl_to_reference_is_logged_only_with_a_reference_model(tiny_model_dir, engine, arithmetic_files, tmp_path):
    for estimator, kl_coef, logged in (("grpo", 0.0, False), ("dr_grpo", 0.0, False), ("gae", 0.05, True)):
        trainer, module, datamodule, _ = build_run(
            tiny_model_dir, engine, arithmetic_files, tmp_path, advantage_estimator=estimator, kl_coef=kl_coef
        )
        trainer.fit(module, datamodule=datamodule)
        row = module.history[-1]
        assert ("rollout/kl_to_reference" in row) is logged and ("rollout/kl_coef" in row) is logged, estimator
        assert "rollout/logprob_abs_diff" in row and row["rollout/logprob_abs_diff"] < 1e-3


def test_reward_counts_are_summed_over_ranks_and_rates_averaged():
    """Two ranks with 3 reward errors each logged 3 (a mean of counts); they are 6. Rates stay the ranks' mean."""
    from lit_ppo.rewards import COUNT_METRICS
    from lit_ppo.training.experience import Experience
    from lit_ppo.training.metrics import rollout_metrics

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    zeros = torch.zeros(2, 3)
    exp = Experience(
        mask=mask,
        old_logp=zeros,
        advantages=zeros,
        returns=zeros,
        rewards=torch.tensor([1.0, 0.0]),
        kl=zeros,
        values=zeros,
    )
    row = rollout_metrics(
        exp,
        torch.zeros(2),
        {"errors": 3.0, "timeouts": 1.0, "none": 0.0, "correct": 0.5},
        world_size=2,
        count_metrics=COUNT_METRICS,
        global_sum=lambda x: 2 * x,
        global_max=lambda x: x,
    )  # two ranks holding the same numbers
    assert (row["rollout/reward_errors"], row["rollout/reward_timeouts"], row["rollout/reward_none"]) == (6.0, 2.0, 0.0)
    assert row["rollout/reward_correct"] == pytest.approx(0.5)
