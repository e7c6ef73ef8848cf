"""On-policy distillation (issue 52): the advantage and the loss against loops written from the peers' definitions on
the same tensors (tinker-cookbook's `distillation/train_on_policy.py`, prime-rl's `trainer/rl/loss.py`), the settings
refused in one line, the teacher's tokenizer refused before any model loads, and the plan's teacher rows."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lit_ppo import algorithms as alg
from lit_ppo.config import DistillConfig, ModelConfig, PPOConfig, RolloutConfig, TeacherConfig, tokenizer_mismatch
from lit_ppo.errors import ConfigError
from lit_ppo.plan import compute_plan
from lit_ppo.run.entry import compose_run_config
from tests.helpers import run_config

F64 = torch.float64
GROUP = 4


def distill_batch(seed: int = 0):
    """8 samples (2 prompt groups of 4) of up to 7 tokens: rewards, mask, the sampler's (student's) and the teacher's
    log-probs of the sampled tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 7, 2, 4])
    mask = (torch.arange(7)[None] < lengths[:, None]).to(F64)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=F64)
    student = -torch.rand(8, 7, generator=g, dtype=F64) * 3 * mask
    teacher = -torch.rand(8, 7, generator=g, dtype=F64) * 3 * mask
    return rewards, mask, student, teacher


def tinker_advantages(rewards, mask, sampled_logprobs, teacher_logprobs, kl_penalty_coef):
    """tinker-cookbook, one datum at a time: the trajectory's advantage (reward - its group's mean,
    `compute_advantages`) on every action token, then `incorporate_kl_penalty` adds
    -kl_penalty_coef * mask * (sampled - teacher) (kl_discount_factor 0)."""
    out = torch.zeros_like(mask)
    for i in range(len(rewards)):
        group = rewards[i // GROUP * GROUP : i // GROUP * GROUP + GROUP]
        advantage = float(rewards[i] - group.mean())
        for t in range(mask.shape[1]):
            if mask[i, t]:
                reverse_kl = float(sampled_logprobs[i, t] - teacher_logprobs[i, t])
                out[i, t] = advantage - kl_penalty_coef * reverse_kl
    return out


def prime_rl_advantages(rewards, mask, trainer_logprobs, teacher_logprobs, adv_tau, teacher_tau, std: bool):
    """prime-rl, one token at a time: adv_tau * (the reward's group advantage) + teacher_tau * (teacher_logprob -
    trainer_logprob), detached; the group advantage with the group's unbiased std (`std`) or without."""
    out = torch.zeros_like(mask)
    for i in range(len(rewards)):
        group = rewards[i // GROUP * GROUP : i // GROUP * GROUP + GROUP]
        advantage = float(rewards[i] - group.mean())
        if std:
            advantage /= float(group.std()) + 1e-6
        for t in range(mask.shape[1]):
            if mask[i, t]:
                out[i, t] = adv_tau * advantage + teacher_tau * float(teacher_logprobs[i, t] - trainer_logprobs[i, t])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pure_distillation_advantage_is_the_negative_reverse_kl_of_both_peers(seed):
    rewards, mask, student, teacher = distill_batch(seed)
    ours, returns = alg.on_policy_distill(
        rewards, mask, student_logp=student, teacher_logp=teacher, teacher_coef=0.7, group_size=GROUP
    )
    zero_rewards = torch.zeros_like(rewards)  # tinker's datasets without a reward: its group advantage is 0
    torch.testing.assert_close(ours, tinker_advantages(zero_rewards, mask, student, teacher, 0.7))
    torch.testing.assert_close(ours, prime_rl_advantages(rewards, mask, student, teacher, 0.0, 0.7, std=False))
    torch.testing.assert_close(returns, ours)
    assert (ours[mask == 0] == 0).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_distillation_with_a_reward_term_matches_both_peers(seed):
    rewards, mask, student, teacher = distill_batch(seed)

    def ours(estimator, teacher_coef, reward_coef):
        return alg.on_policy_distill(
            rewards,
            mask,
            student_logp=student,
            teacher_logp=teacher,
            teacher_coef=teacher_coef,
            reward_coef=reward_coef,
            reward_estimator=estimator,
            group_size=GROUP,
        )[0]

    # tinker: the reward's group-mean advantage with weight 1 (Dr. GRPO's), plus the teacher term
    torch.testing.assert_close(ours("dr_grpo", 0.5, 1.0), tinker_advantages(rewards, mask, student, teacher, 0.5))
    # prime-rl: adv_tau x GRPO's advantage + teacher_tau x the teacher term
    expected = prime_rl_advantages(rewards, mask, student, teacher, 0.3, 2.0, std=True)
    torch.testing.assert_close(ours("grpo", 2.0, 0.3), expected)


def test_distillation_loss_and_gradient_match_the_peers_importance_sampling_losses():
    """The training loss (`actor_token_loss`, ppo's clipped surrogate, token-mean) on distillation advantages, with the
    current log-probs near the sampler's (ratios inside the clip): its value is tinker's importance-sampling loss,
    -sum(exp(logp - sampled) * A) per token, and its gradient prime-rl's, -(sg(ratio * A) * logp).sum(); both divided
    by the tokens, as token-mean does."""
    rewards, mask, student, teacher = distill_batch(3)
    advantages, _ = alg.on_policy_distill(
        rewards, mask, student_logp=student, teacher_logp=teacher, reward_coef=0.5, group_size=GROUP
    )
    g = torch.Generator().manual_seed(4)
    logp = (student + 0.1 * (torch.rand(mask.shape, generator=g, dtype=F64) - 0.5) * mask).requires_grad_(True)
    tokens = mask.sum()

    loss_tok, _, clipped = alg.actor_token_loss(
        logp,
        student,
        advantages,
        mask,
        torch.zeros_like(mask),
        policy_loss="ppo",
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )
    assert float((clipped * mask).sum()) == 0  # inside the clip range: the peers' unclipped losses apply
    ours = alg.aggregate_loss(loss_tok, mask, "token-mean")
    (ours_grad,) = torch.autograd.grad(ours, logp)

    tinker_loss = sum(
        -torch.exp(logp[i, t] - student[i, t]) * advantages[i, t]
        for i in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[i, t]
    )
    torch.testing.assert_close(ours, tinker_loss / tokens)
    ratio = torch.exp(logp - student).detach()
    prime_loss = -((ratio * advantages) * logp)[mask > 0].sum() / tokens
    (prime_grad,) = torch.autograd.grad(prime_loss, logp)
    torch.testing.assert_close(ours_grad, prime_grad)
    assert ours_grad.abs().max() > 1e-3


def test_teacher_term_is_clamped_like_every_log_ratio():
    mask = torch.ones(1, 2, dtype=F64)
    student, teacher = torch.tensor([[-50.0, -1.0]], dtype=F64), torch.tensor([[-1.0, -80.0]], dtype=F64)
    advantages, _ = alg.on_policy_distill(torch.zeros(1, dtype=F64), mask, student_logp=student, teacher_logp=teacher)
    assert advantages.tolist() == [[alg.LOG_RATIO_CLAMP, -alg.LOG_RATIO_CLAMP]]


# ------------------------------------------------------------------ settings


def distill_ppo(**changes) -> PPOConfig:
    return PPOConfig(**{"advantage_estimator": "on_policy_distill", "kl_coef": 0.0, **changes})


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: run_config(ppo=distill_ppo()), "needs a teacher; fix: ppo=distill model.teacher.path=<a model"),
        (
            lambda: run_config(ppo=distill_ppo(), model=ModelConfig(teacher=TeacherConfig())),
            "fix: model.teacher.path=<a model directory>, or model.teacher.where=http://",
        ),
        (
            lambda: run_config(ppo=PPOConfig(), model=ModelConfig(teacher=TeacherConfig(path="t"))),
            "never reads a teacher",
        ),
        (lambda: distill_ppo(kl_coef=0.01, kl_mode="reward"), "fix: ppo.kl_mode=loss, or ppo.kl_coef=0"),
        (
            lambda: distill_ppo(dynamic_sampling={"enabled": True}),  # replaced below by the dataclass
            "ppo.dynamic_sampling.enabled=true with ppo.distill.reward_coef=0",
        ),
        (lambda: DistillConfig(reward_estimator="gae"), "without a critic"),
        (lambda: DistillConfig(teacher_coef=0.0, reward_coef=0.0), "every advantage would be 0"),
        (lambda: TeacherConfig(path="t", dtype="int8"), "model.teacher.dtype='int8' is unknown"),
        (lambda: TeacherConfig(where="host:8000"), "neither the trainer nor a server's URL; fix: model.teacher.where="),
        (lambda: TeacherConfig(path="t", where="http://host:8000"), "fix: model.teacher.path=null"),
        (
            lambda: run_config(
                ppo=distill_ppo(), model=ModelConfig(teacher=TeacherConfig(path="t")), rollout=RolloutConfig(top_p=0.9)
            ),
            "rollout.top_p=0.9 with ppo.advantage_estimator=on_policy_distill: the samples come from the nucleus",
        ),
        (
            lambda: run_config(
                ppo=distill_ppo(),
                model=ModelConfig(teacher=TeacherConfig(where="http://host:8000")),
                rollout=RolloutConfig(temperature=0.7),
            ),
            "at temperature 0.7 (rollout.temperature), but a vLLM server's prompt log-probs are untempered; fix: "
            "rollout.temperature=1.0 (the student sampled at the teacher's temperature), or "
            "model.teacher.temperature=1.0 (the teacher at 1, the student at 0.7)",
        ),
        (
            lambda: run_config(
                ppo=distill_ppo(), model=ModelConfig(teacher=TeacherConfig(where="http://h:1", temperature=0.5))
            ),
            "at temperature 0.5 (model.teacher.temperature)",
        ),
        (
            lambda: run_config(
                ppo=distill_ppo(n_samples_per_prompt=1, rollout_batch_size=64, distill=DistillConfig(reward_coef=1.0)),
                model=ModelConfig(teacher=TeacherConfig(path="t")),
            ),
            "compares samples of one prompt",
        ),
    ],
    ids=[
        "no-teacher",
        "preset-without-path",
        "teacher-without-distill",
        "kl-in-reward",
        "dynamic-sampling",
        "gae-reward",
        "all-zero",
        "dtype",
        "where-not-a-url",
        "server-and-path",
        "top-p",
        "server-at-sampling-temperature",
        "server-at-teacher-temperature",
        "group-of-one",
    ],
)
def test_impossible_settings_are_refused_in_one_line(build, words):
    if "dynamic_sampling" in words:
        from lit_ppo.config import DynamicSamplingConfig

        build = lambda: distill_ppo(dynamic_sampling=DynamicSamplingConfig(enabled=True))  # noqa: E731
    with pytest.raises(ConfigError) as error:
        build()
    assert words in str(error.value) and "\n" not in str(error.value)


def test_the_preset_composes_with_a_teacher_and_plans_it(tmp_path):
    config = compose_run_config("ppo=distill", "model.teacher.path=/nowhere/teacher", "mode=plan")
    assert config.ppo.advantage_estimator == "on_policy_distill" and config.model.teacher.path == "/nowhere/teacher"
    assert config.ppo.distill == DistillConfig() and config.ppo.kl_coef == 0
    plan = compute_plan(config, 1000)
    assert plan.models.critic_enabled is False and plan.models.reference_enabled is False
    assert plan.old_logprobs.source == "experience forward"  # the teacher term needs them before the update
    assert plan.teacher.forwards_per_rollout_step == 128 // 32  # samples per rank / micro-batch size
    table = plan.table()
    assert "teacher model" in table and "/nowhere/teacher" in table and "teacher forwards" in table
    assert json.loads(plan.to_json())["teacher"]["path"] == "/nowhere/teacher"
    # without a teacher: no section, no rows; an older plan.json without the section reads as one with it off
    plain = compute_plan(compose_run_config("ppo=grpo"), 1000)
    assert plain.teacher is None and "teacher" not in plain.table()
    from lit_ppo.plan import sections_of

    older = {k: v for k, v in plain.to_dict().items() if k != "teacher"}
    assert sections_of(older) == plain.to_dict()


@pytest.mark.parametrize("overrides", [["ppo=distill"], ["ppo.advantage_estimator=on_policy_distill"]])
def test_the_fix_for_a_missing_teacher_composes_as_written(overrides):
    """With the preset (model.teacher declared, its path null) and without it (model.teacher absent): the line's fix,
    given as it is written, composes a run with the teacher (no Hydra struct error)."""
    with pytest.raises(ConfigError) as error:
        compose_run_config(*overrides, "ppo.kl_coef=0")
    message = str(error.value)
    fix = message.split("fix: ")[1].replace("<a model directory>", "/t")
    written = fix.split(" (or ")[0].split(", or ")[0].split()
    config = compose_run_config(*overrides, "ppo.kl_coef=0", *[w for w in written if w not in overrides])
    assert config.model.teacher.path == "/t" and config.ppo.advantage_estimator == "on_policy_distill"
    if "(or +model.teacher.path" in fix:  # the preset-free form it names
        config = compose_run_config(*overrides, "ppo.kl_coef=0", "+model.teacher.path=/t")
        assert config.model.teacher.path == "/t"


# ------------------------------------------------------------------ the teacher's tokenizer


def saved_tokenizer(tmp_path, name, change=None):
    """A model directory's tokenizer files (and a config.json) of the tiny model's tokenizer, changed by `change`."""
    from lit_ppo.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if change is not None:
        change(tokenizer)
    directory = tmp_path / name
    tokenizer.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return directory


def test_tokenizer_mismatch_names_the_vocabulary_and_the_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    def load(name, change=None):
        return AutoTokenizer.from_pretrained(saved_tokenizer(tmp_path, name, change))

    student = load("student")
    assert tokenizer_mismatch(student, load("same")) is None
    assert "vocabularies of" in tokenizer_mismatch(student, load("more", lambda t: t.add_tokens(["<extra>"])))
    other_eos = load("eos", lambda t: setattr(t, "eos_token", "<|im_end|>"))  # the same vocabulary
    assert tokenizer_mismatch(student, other_eos) == "eos_token '<|endoftext|>' and '<|im_end|>' differ"
    not_special = load("plain", lambda t: t.add_tokens(["<extra>"]))
    special = load("special", lambda t: t.add_special_tokens({"additional_special_tokens": ["<extra>"]}))
    assert tokenizer_mismatch(not_special, special).startswith("special tokens")


def test_a_teacher_of_another_tokenizer_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """A training run's pre-flight reads the teacher's tokenizer files, compares them with the student's (the tiny
    model's) and refuses in one line; no model is loaded (from_pretrained would fail the test)."""
    import transformers

    from lit_ppo.run.prepare import preflight

    teacher = saved_tokenizer(tmp_path, "teacher", lambda t: t.add_tokens(["<extra>"]))

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the teacher's tokenizer was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    config = compose_run_config("ppo=distill", f"model.teacher.path={teacher}", "model.warm_start.enabled=false")
    with pytest.raises(ConfigError) as error:
        preflight(config, tmp_path / "run")
    message = str(error.value)
    assert f"model.teacher.path={teacher}: its tokenizer is not the student's" in message and "\n" not in message
    # the same tokenizer passes
    same = saved_tokenizer(tmp_path, "same")
    preflight(dataclasses.replace(config, model=dataclasses.replace(config.model, teacher=TeacherConfig(str(same)))))


def test_a_run_directory_as_the_teacher_names_its_actor(tmp_path):
    """`model.teacher.path=<run>` (the run, not its final policy): one line naming `<run>/actor`."""
    from lit_ppo.demo.tiny import build_char_tokenizer
    from lit_ppo.run.teacher_preflight import check_teacher_files

    (tmp_path / "run" / "actor").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"without config\.json; fix: model\.teacher\.path=.*run/actor \(the run's"):
        check_teacher_files(str(tmp_path / "run"), build_char_tokenizer(), "the tiny model", training=True)


def test_a_collective_timeout_shorter_than_the_server_teachers_tries_is_refused_in_one_line():
    """Ranks wait for each other in a collective while one waits for the teacher's server: their wait must be the
    longer, so that every rank stops with the teacher's line (a server teacher's tries: 3 x 500 s + 2 + 4 s)."""
    from lit_ppo.config.distill import server_teacher_wait_s

    teacher = ("ppo=distill", "model.teacher.where=http://host:8000", "model.teacher.temperature=1.0")
    ddp = ("strategy=ddp", "strategy.devices=2", "strategy.accelerator=cpu")
    assert server_teacher_wait_s() == 1506
    with pytest.raises(ConfigError) as error:
        compose_run_config(*teacher, *ddp, "trainer.collective_timeout_s=1500")
    message = str(error.value)
    assert message.startswith("trainer.collective_timeout_s=1500 with 2 trainer ranks and model.teacher.where=")
    assert "fix: trainer.collective_timeout_s above 1506" in message and "\n" not in message
    compose_run_config(*teacher, *ddp)  # the default 1800 s
    # one context-parallel group (one data-parallel rank): its other rank waits for rank 0's answer in a broadcast
    with pytest.raises(ConfigError, match=r"^trainer.collective_timeout_s=1500 with 2 trainer ranks and model.teacher"):
        compose_run_config(*teacher, *ddp, "strategy.context_parallel_size=2", "trainer.collective_timeout_s=1500")
    compose_run_config(*teacher, "trainer.collective_timeout_s=1500")  # one rank: no collective
