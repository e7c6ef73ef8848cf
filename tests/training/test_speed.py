"""Work the trainer can skip without changing the update (issue 14): the actor's experience forward when the update is
exactly on-policy (`ppo.old_logprobs`), and padding, with micro-batches cut by a token budget
(`ppo.micro_train_max_tokens`). Each run here is one real rollout step (Lightning trainer, PPOModule) on a fixed
batch of variable-length samples, without vLLM."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lit_ppo.batch import RolloutBatch
from lit_ppo.config import PPOConfig, RolloutConfig, RolloutCorrectionConfig, parse_section
from lit_ppo.errors import ConfigError, RolloutMismatchError
from lit_ppo.run.report import write_plan
from lit_ppo.testing import synthetic_rollout_batch
from lit_ppo.training.batching import micro_batch_groups, pack, padding_fraction
from lit_ppo.training.module import PPOModule
from tests.helpers import ROOT, plan_of
from tests.helpers.fixed_batch import train_on_fixed_batch

# 4 prompts x 2 samples, on-policy (train_batch_size = samples per rollout step), GRPO with a k3 KL in the loss.
ON_POLICY = {
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 2,
    "train_batch_size": 8,
    "micro_train_batch_size": 4,
    "advantage_estimator": "grpo",
    "kl_coef": 0.01,
    "kl_mode": "loss",
    "kl_estimator": "k3",
    "loss_agg_mode": "seq-mean-token-mean",
    "actor_lr": 1e-3,
}


def fixed_batch(n_prompts: int = 4, n: int = 2, seed: int = 0) -> RolloutBatch:
    """Prompts of 3-20 tokens and responses of 1-14, random ids (4+: not special), rewards 0/1 differing in groups."""
    return synthetic_rollout_batch(n_prompts, n, (3, 20), (1, 14), seed=seed)


def run_one_step(model_dir, files, tmp_path, batch: RolloutBatch, **overrides):
    """One rollout step on `batch`; returns the module, the actor's forwards in the experience phase, the reference's
    forwards, and the actor's gradient (before clipping) at each optimizer step."""
    ppo = PPOConfig(**{**ON_POLICY, **overrides})
    rollout = RolloutConfig(max_response_tokens=16)
    calls = {"phase": "", "experience": 0, "reference": 0}

    def count_forwards(module: PPOModule) -> None:
        def count_actor(*_):
            calls["experience"] += calls["phase"] == "experience"

        def count_reference(*_):
            calls["reference"] += 1

        module.actor.register_forward_pre_hook(count_actor)
        module.reference.register_forward_pre_hook(count_reference)
        make_experience = module.make_experience

        def counted_experience(b):
            calls["phase"] = "experience"
            try:
                return make_experience(b)
            finally:
                calls["phase"] = ""

        module.make_experience = counted_experience

    module, grads = train_on_fixed_batch(
        model_dir,
        files[0],
        tmp_path,
        batch,
        ppo,
        rollout,
        lambda prompts: plan_of(prompts, ppo=ppo, rollout=rollout),
        grads_of="actor",
        prepare=count_forwards,
        temperature=0.7,
        max_logprob_abs_diff=0.5,
    )
    return module, calls, grads


def assert_same_gradients(a: list[dict], b: list[dict], rel: float = 1e-4) -> None:
    """Equal up to float32 rounding: within `rel` of each tensor's largest gradient (micro-batches of another
    composition pad differently and sum in another order)."""
    assert len(a) == len(b) and a
    for step_a, step_b in zip(a, b):
        assert step_a.keys() == step_b.keys()
        for name in step_a:
            scale = float(step_b[name].abs().max())
            assert scale > 0, name
            torch.testing.assert_close(
                step_a[name], step_b[name], rtol=rel, atol=rel * scale, msg=lambda m, name=name: f"{name}: {m}"
            )


# ---------------------------------------------------------------- the plan


@pytest.mark.parametrize(
    "overrides, source",
    [
        ({}, "training forward"),  # on-policy, KL in the loss: nothing needs the old log-probs before the update
        ({"train_batch_size": 4, "micro_train_batch_size": 2}, "experience forward"),  # 2 mini-batches
        ({"ppo_epochs": 2}, "experience forward"),
        ({"kl_mode": "reward", "kl_estimator": "k1", "advantage_estimator": "reinforce_pp"}, "experience forward"),
        ({"rollout_correction": {"mode": "tis"}}, "experience forward"),
        ({"old_logprobs": "recompute"}, "experience forward"),
        ({"old_logprobs": "rollout", "ppo_epochs": 2}, "vLLM"),
    ],
    ids=["on-policy", "two-mini-batches", "two-epochs", "kl-in-reward", "tis", "recompute", "rollout"],
)
def test_plan_says_where_old_logprobs_come_from(overrides, source, tmp_path):
    ppo = parse_section(PPOConfig, {**ON_POLICY, **overrides}, "ppo")
    plan = plan_of(64, ppo=ppo)
    assert plan.old_logprobs.source == source
    assert any(line.startswith("old log-probs") and source in line for line in plan.table().splitlines())
    write_plan(plan, tmp_path, "test")
    assert json.loads((tmp_path / "plan.json").read_text())["old_logprobs"]["source"] == source
    if (
        overrides.get("kl_mode") == "reward" or "rollout_correction" in overrides
    ):  # on-policy, yet the forward runs: why
        assert any("old log-probs: the update is on-policy" in n for n in plan.notes)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"old_logprobs": "vllm"}, r"^ppo.old_logprobs='vllm' is unknown; fix: use one of auto, recompute, rollout$"),
        (
            {"old_logprobs": "rollout", "rollout_correction": {"mode": "tis"}},
            r"^ppo.old_logprobs=rollout .* ppo.rollout_correction.mode=tis has no mismatch left .*; fix: ",
        ),
        ({"micro_train_max_tokens": 0}, r"^ppo.micro_train_max_tokens=0 must be a positive integer; fix: "),
    ],
    ids=["unknown-source", "rollout-with-tis", "zero-token-budget"],
)
def test_old_logprobs_settings_that_cannot_work_are_refused(settings, message):
    """Refused in one line where a user's `ppo.*` settings enter (`parse_section`, what `RunConfig.from_hydra` calls),
    and by `PPOConfig` built in code: its `__post_init__` runs `validate_ppo`, so no invalid config exists to validate
    later (the test called `validate_ppo(PPOConfig(...))` before, whose `validate_ppo` was never reached)."""
    with pytest.raises(ConfigError, match=message):
        parse_section(PPOConfig, settings, "ppo")
    in_code = {k: RolloutCorrectionConfig(**v) if isinstance(v, dict) else v for k, v in settings.items()}
    with pytest.raises(ConfigError, match=message):
        PPOConfig(**in_code)


# ---------------------------------------------------------------- no experience forward when on-policy


def test_on_policy_update_skips_the_actor_forward_with_the_same_gradients(tiny_model_dir, arithmetic_files, tmp_path):
    batch = fixed_batch()
    skipped, skipped_calls, skipped_grads = run_one_step(tiny_model_dir, arithmetic_files, tmp_path / "a", batch)
    forward, forward_calls, forward_grads = run_one_step(
        tiny_model_dir, arithmetic_files, tmp_path / "b", batch, old_logprobs="recompute"
    )
    assert skipped.plan.old_logprobs.source == "training forward"
    assert forward_calls["experience"] == 2 and skipped_calls["experience"] == 0  # 8 samples, micro-batches of 4
    assert skipped_calls["reference"] == forward_calls["reference"] == 2  # the reference log-probs keep their pass
    assert skipped.actor_optimizer_steps == forward.actor_optimizer_steps == 1
    assert_same_gradients(skipped_grads, forward_grads)
    row, row_forward = skipped.history[-1], forward.history[-1]
    assert row["actor/approx_kl"] == 0 and row["actor/clip_fraction"] == 0  # ratio exactly 1
    # the KL to the reference is still logged, from the training forwards' log-probs (= the old ones)
    assert row["rollout/kl_to_reference"] == pytest.approx(row_forward["rollout/kl_to_reference"], rel=1e-4, abs=1e-8)


def test_rollout_logprobs_as_old_ones(tiny_model_dir, arithmetic_files, tmp_path):
    """ppo.old_logprobs=rollout: no actor forward in the experience, the PPO ratio against vLLM's log-probs (here: the
    actor's own, as a vLLM in sync gives them), in every mini-batch of an off-policy update."""
    two_mini_batches = {"train_batch_size": 4, "micro_train_batch_size": 2}
    batch = fixed_batch()
    forward, _, forward_grads = run_one_step(
        tiny_model_dir, arithmetic_files, tmp_path / "a", batch, old_logprobs="recompute", **two_mini_batches
    )
    # What a vLLM in sync with the actor reports: the actor's log-probs of the sampled tokens at temperature 0.7.
    module = PPOModule(
        model_dir=tiny_model_dir,
        ppo=forward.ppo,
        plan=forward.plan,
        pad_token_id=0,
        temperature=0.7,
    )
    with torch.no_grad():
        mb = pack(batch.prompt_ids, batch.response_ids, 0, "cpu")
        logp = module.response_logprobs(module.actor, mb)
    batch = dataclasses.replace(
        batch, rollout_logprobs=[logp[i, : len(r)].tolist() for i, r in enumerate(batch.response_ids)]
    )
    rollout, calls, grads = run_one_step(
        tiny_model_dir, arithmetic_files, tmp_path / "b", batch, old_logprobs="rollout", **two_mini_batches
    )
    assert rollout.plan.old_logprobs.source == "vLLM" and calls["experience"] == 0
    assert rollout.actor_optimizer_steps == 2
    assert_same_gradients(grads, forward_grads)
    assert rollout.history[-1]["rollout/logprob_abs_diff"] < 1e-5  # checked against the first mini-batch's forwards


def test_skipped_forward_still_catches_a_sampler_out_of_sync(tiny_model_dir, arithmetic_files, tmp_path):
    """The check of vLLM's log-probs against the trainer's (rollout.max_logprob_abs_diff) runs on the training
    forwards' log-probs when there is no experience forward."""
    batch = fixed_batch()
    batch = dataclasses.replace(batch, rollout_logprobs=[[-0.01] * len(r) for r in batch.response_ids])
    with pytest.raises(RolloutMismatchError, match="differ from vLLM's"):
        run_one_step(tiny_model_dir, arithmetic_files, tmp_path, batch)


# ---------------------------------------------------------------- token-budget micro-batches


def test_micro_batch_groups_by_token_budget_hand_case():
    prompts, responses = [5, 5, 3, 3, 3], [10, 1, 2, 9, 2]  # totals 15, 6, 5, 12, 5
    fixed = micro_batch_groups(prompts, responses, [0, 1, 2, 3, 4], max_samples=2)
    # fixed size, longest first (ties keep their order): 0, 3, 1, 2, 4 in runs of 2
    assert fixed == [[0, 3], [1, 2], [4]]
    # [0,3] 2 x (5+10) = 30, [1,2] 2 x (5+2) = 14, [4] 1 x 5 = 5: 49 positions; in the given order it would be
    # [0,1] 30 + [2,3] 2 x (3+9) = 24 + [4] 5 = 59
    assert padding_fraction(prompts, responses, fixed) == pytest.approx(1 - 43 / 49)
    assert padding_fraction(prompts, responses, [[0, 1], [2, 3], [4]]) == pytest.approx(1 - 43 / 59)
    # longest first: [0] 15, [0,3] would be 2 x 15 = 30 > 24, so [0]; [3, 1] = 2 x (5 + 9) = 28 > 24, so [3];
    # [1, 2, 4] = 3 x (5 + 2) = 21 <= 24
    budget = micro_batch_groups(prompts, responses, [0, 1, 2, 3, 4], max_samples=2, max_tokens=24)
    assert budget == [[0], [3], [1, 2, 4]]
    assert padding_fraction(prompts, responses, budget) == pytest.approx(1 - 43 / (15 + 12 + 21))
    # ranks with fewer micro-batches split their largest until they run as many as the others
    assert micro_batch_groups(prompts, responses, [0, 1, 2, 3, 4], max_samples=2, max_tokens=24, min_count=4) == [
        [0],
        [3],
        [1],
        [2, 4],
    ]


def test_token_budget_micro_batches_same_gradients_less_padding(tiny_model_dir, arithmetic_files, tmp_path):
    batch = fixed_batch(n_prompts=4, n=4)  # 16 samples; two mini-batches of 8, fixed micro-batches of 2
    settings = {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "train_batch_size": 8, "micro_train_batch_size": 2}
    # the padded layout's budget (packed micro-batches pad ~nothing: tests/training/test_packing.py)
    settings["packing"] = False
    fixed, _, fixed_grads = run_one_step(tiny_model_dir, arithmetic_files, tmp_path / "a", batch, **settings)
    budget, _, budget_grads = run_one_step(
        tiny_model_dir, arithmetic_files, tmp_path / "b", batch, micro_train_max_tokens=48, **settings
    )
    assert budget.actor_optimizer_steps == fixed.actor_optimizer_steps == 2  # the plan's count (checked at runtime too)
    assert budget.plan.layout.micro_train_max_tokens == 48
    assert_same_gradients(budget_grads, fixed_grads)
    padding, padding_fixed = budget.history[-1]["perf/padding_fraction"], fixed.history[-1]["perf/padding_fraction"]
    assert 0 <= padding < padding_fixed


@pytest.mark.slow  # a performance property (a fresh engine of its own); the warm-up runs at every engine start
def test_the_first_rollout_batch_after_engine_start_compiles_nothing(tiny_model_dir):
    """vLLM compiles its log-prob ranking kernel (torch.compile) on first use; VLLMEngine pays that at start-up
    (`_warm_up`), so the first rollout step is timed like the others. Checked in a fresh process (this one's engine
    may have compiled it already) on a rollout-sized call: 48 prompts of 100 tokens x 4 samples at temperature 0.7,
    more prefill than one vLLM scheduler step takes (4,096 tokens)."""
    import subprocess
    import sys

    code = f"""
import random, time
import torch._dynamo.utils as dynamo_utils
from lit_ppo.contract import GenerateRequest
from lit_ppo.rollout.engine import VLLMEngine
engine = VLLMEngine({tiny_model_dir!r}, max_model_len=128, seed=0)
compiled_at_start = dynamo_utils.counters["frames"]["total"]
rng = random.Random(0)
prompts = [[rng.randrange(3, 40) for _ in range(100)] for _ in range(48)]
started = time.perf_counter()
out = engine.generate(GenerateRequest(prompts, n=4, temperature=0.7, top_p=1.0, max_tokens=16, seeds=list(range(48))))
print("FIRST_GENERATE_S", time.perf_counter() - started)
print("RESPONSES", len(out), "WITH_LOGPROBS", sum(len(g.logprobs) == len(g.token_ids) > 0 for g in out))
print("FRAMES_COMPILED_AT_START", compiled_at_start)
print("FRAMES_COMPILED_AFTER", dynamo_utils.counters["frames"]["total"] - compiled_at_start)
"""
    root = ROOT
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    keys = ("FIRST_GENERATE_S", "RESPONSES", "FRAMES_COMPILED_AT_START", "FRAMES_COMPILED_AFTER")
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(keys))
    assert "FRAMES_COMPILED_AFTER" in lines, result.stderr[-3000:]
    assert lines["RESPONSES"] == "192 WITH_LOGPROBS 192"
    assert int(lines["FRAMES_COMPILED_AT_START"]) >= 1  # the warm-up compiled it (else this test checks nothing)
    assert int(lines["FRAMES_COMPILED_AFTER"]) == 0, result.stdout
