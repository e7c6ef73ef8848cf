"""On-policy distillation's teacher in the trainer (issue 52): its log-probs in every layout against a plain
`transformers` forward of the same sequences, and short `ppo=distill` runs (vLLM, a LoRA student) whose update is the
teacher's: not tiny with another teacher, exactly none with the student as its own teacher."""

from __future__ import annotations

import functools

import pytest
import torch

from lit_ppo.config import LoraConfig, ModelConfig, RolloutConfig, TeacherConfig
from lit_ppo.plan import compute_plan
from lit_ppo.testing import synthetic_rollout_batch
from lit_ppo.training.module import PPOModule
from tests.helpers import build_run, distill_ppo, run_config

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_model_dir) -> str:
    """Another model of the fixture model's shape and tokenizer (other random weights): the teacher."""
    from tests.helpers import save_fixture_model

    return save_fixture_model(tmp_path_factory.mktemp("teacher") / "model", seed=1)


@functools.cache
def plain_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def plain_logprobs(model_dir: str, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response token | what precedes it) by one plain `transformers` forward of prompt + response, at the
    sampling temperature."""
    model = plain_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].double() / TEMPERATURE
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return torch.log_softmax(logits[positions], -1)[torch.arange(len(response)), torch.tensor(response)]


@pytest.mark.parametrize("packing, shared_prefix", [(False, False), (True, False), (True, True)])
def test_teacher_logprobs_equal_a_plain_transformers_forward(tiny_model_dir, teacher_dir, packing, shared_prefix):
    """The experience's teacher log-probs (padded rows, packed rows, the shared-prefix layout: the reference model's
    forward path) are a plain forward's of each sequence, to float32 rounding; the advantage is the student's minus
    them, negated."""
    module = distill_module(tiny_model_dir, teacher_dir, packing=packing, shared_prefix=shared_prefix)
    assert module.plan.layout.packing is packing and module.plan.layout.shared_prefix is shared_prefix
    batch = synthetic_rollout_batch(3, 4, (5, 30), (1, 40), seed=0)
    exp = module.make_experience(batch)
    for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        expected = plain_logprobs(teacher_dir, prompt, response).float()
        torch.testing.assert_close(exp.teacher_logp[i, : len(response)], expected, rtol=0, atol=2e-5)
        student = plain_logprobs(tiny_model_dir, prompt, response).float()
        torch.testing.assert_close(exp.advantages[i, : len(response)], -(student - expected), rtol=0, atol=4e-5)
    assert float(exp.mask.sum()) == sum(len(r) for r in batch.response_ids)


def distill_run(model_dir, engine, files, tmp_path, teacher: str, steps: int = 2, **kwargs):
    """`steps` rollout steps of on-policy distillation on the fixture model; the module and its actor's trained
    tensors before the run."""
    trainer, module, datamodule, plan = build_run(
        model_dir,
        engine,
        files,
        tmp_path,
        total_rollout_steps=steps,
        teacher=TeacherConfig(path=teacher),
        advantage_estimator="on_policy_distill",
        kl_coef=0.0,
        loss_agg_mode="token-mean",
        **kwargs,
    )
    before = {n: p.detach().clone() for n, p in module.actor.named_parameters() if p.requires_grad}
    trainer.fit(module, datamodule=datamodule)
    assert module.actor_optimizer_steps == plan.counts.total_optimizer_steps and module.teacher is not None
    return module, before


def relative_change(module, before) -> float:
    after = dict(module.actor.named_parameters())
    change = sum(float((after[n].detach() - p).abs().sum()) for n, p in before.items())
    return change / sum(float(p.abs().sum()) for p in before.values())


@pytest.mark.slow  # two runs with vLLM sampling (about 50 s on 2 busy cores)
def test_a_distillation_run_moves_the_student_by_the_teacher(
    tiny_model_dir, teacher_dir, engine, arithmetic_files, tmp_path
):
    """Two rollout steps with vLLM sampling: every step logs the teacher's metrics and the update is not tiny; the
    control, the student as its own teacher, has advantages of exactly 0 and leaves the student where it was."""
    module, before = distill_run(tiny_model_dir, engine, arithmetic_files, tmp_path / "teacher", teacher_dir)
    rows = module.history
    assert len(rows) == 2 and all(r["teacher/logprob_gap"] > 0.01 for r in rows)
    assert all(abs(r["teacher/reverse_kl"]) <= r["teacher/logprob_gap"] for r in rows)
    moved = relative_change(module, before)
    print(f"relative change of the actor: {moved:.2e}")
    assert moved > 1e-3, moved

    same, before = distill_run(tiny_model_dir, engine, arithmetic_files, tmp_path / "self", tiny_model_dir, steps=1)
    assert same.history[0]["teacher/reverse_kl"] == 0 and same.history[0]["teacher/logprob_gap"] == 0
    assert relative_change(same, before) == 0


@pytest.mark.slow  # about 50 s on 2 busy cores
def test_a_lora_student_learns_from_its_teacher(tiny_model_dir, teacher_dir, arithmetic_files, tmp_path):
    """A LoRA student (rollout.engine=hf: the actor generates, no vLLM engine to start): only its adapter trains, by
    the teacher's advantages."""
    rollout = RolloutConfig(engine="hf", max_response_tokens=6, eval_samples_per_prompt=2)
    module, before = distill_run(
        tiny_model_dir, None, arithmetic_files, tmp_path, teacher_dir, lora=LoraConfig(rank=8), rollout=rollout
    )
    assert before and all("lora_" in n for n in before)
    assert relative_change(module, before) > 1e-3
    assert all(r["teacher/logprob_gap"] > 0.01 for r in module.history)


def distill_module(model_dir: str, teacher: str, **ppo_changes) -> PPOModule:
    """A module distilling `teacher` into `model_dir` (3 prompts x 4 samples, micro-batches of 6), sampling at
    TEMPERATURE."""
    ppo = distill_ppo(**ppo_changes)
    rollout = RolloutConfig(temperature=TEMPERATURE)  # the teacher scores at the sampling temperature
    config = run_config(ppo=ppo, rollout=rollout, model=ModelConfig(teacher=TeacherConfig(path=teacher)))
    return PPOModule(
        model_dir=model_dir, ppo=ppo, plan=compute_plan(config, 3), pad_token_id=0, temperature=TEMPERATURE
    )


def test_with_tool_episodes_only_the_policys_tokens_carry_the_teacher_term(tiny_model_dir, teacher_dir):
    """Episodes of 61-100 response tokens, each with an observation (policy mask 0) inside: the observation tokens
    have no teacher term (advantage 0) and are out of the metrics; every policy token's advantage is
    -(student - teacher) of plain forwards of the whole episode (packed rows)."""
    from lit_ppo.training.experience import teacher_metrics

    batch = synthetic_rollout_batch(3, 4, (5, 20), (61, 100), seed=2, observations=True)
    module = distill_module(tiny_model_dir, teacher_dir, packing=True, shared_prefix=False)
    exp = module.make_experience(batch)
    student_minus_teacher, policy_tokens = [], 0
    for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        policy = torch.tensor(batch.policy_masks[i], dtype=torch.float32)
        assert 0 < float(policy.sum()) < len(response)  # an observation inside every episode
        torch.testing.assert_close(exp.mask[i, : len(response)], policy)
        teacher = plain_logprobs(teacher_dir, prompt, response).float()
        student = plain_logprobs(tiny_model_dir, prompt, response).float()
        expected = -(student - teacher) * policy
        torch.testing.assert_close(exp.advantages[i, : len(response)], expected, rtol=0, atol=4e-5)
        assert (exp.advantages[i, : len(response)][policy == 0] == 0).all()
        student_minus_teacher.append(((student - teacher) * policy).sum())
        policy_tokens += int(policy.sum())
    metrics = teacher_metrics(exp)
    assert metrics["teacher/reverse_kl"] == pytest.approx(float(sum(student_minus_teacher)) / policy_tokens, abs=1e-5)


def test_under_fsdp_the_teacher_is_sharded_and_scores_as_unsharded(tiny_model_dir, teacher_dir, tmp_path):
    """FSDP2 on a 1-rank gloo mesh in this process (PPOModule.configure_model, as ModelParallelStrategy calls it): the
    teacher's parameters are DTensors beside the actor's, and the experience's teacher log-probs and advantages are
    the unsharded module's."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    batch = synthetic_rollout_batch(3, 4, (5, 30), (1, 40), seed=0)
    plain = distill_module(tiny_model_dir, teacher_dir, packing=False).make_experience(batch)
    own_group = not dist.is_initialized()  # an in-process vLLM engine of an earlier test leaves a 1-rank group up
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        module = distill_module(tiny_model_dir, teacher_dir, packing=False)
        module._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
        module.trainer = SimpleNamespace(precision="32-true")  # what configure_model reads of the trainer
        module.configure_model()
        assert module.sharded and all(isinstance(p, DTensor) for p in module.teacher.parameters())
        sharded = module.make_experience(batch)
    finally:
        if own_group:
            dist.destroy_process_group()
    torch.testing.assert_close(sharded.teacher_logp, plain.teacher_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(sharded.advantages, plain.advantages, rtol=0, atol=4e-6)
    assert float(plain.teacher_logp.abs().sum()) > 1


@pytest.mark.slow  # three short runs with vLLM sampling (80 s on 2 busy cores); make test: the preset's 2-step run
def test_a_resumed_distillation_run_matches_an_uninterrupted_one(
    tiny_model_dir, teacher_dir, engine, arithmetic_files, tmp_path
):
    """A distillation run that crashes after rollout step 1 and resumes from its checkpoint: the checkpoint holds no
    teacher tensor (the teacher loads from model.teacher.path again), and the resumed run's step 2 (its teacher
    metrics, the actor's weights) is the uninterrupted run's, bitwise (CPU, fixed seeds, one process)."""
    from lit_ppo.checkpoints import checkpoint_path
    from tests.helpers.resume import assert_same_weights, checkpointed_run

    def run(out, **kwargs):
        return checkpointed_run(
            (tiny_model_dir, arithmetic_files),
            engine,
            out,
            every=1,
            keep=2,
            total_rollout_steps=2,
            teacher=TeacherConfig(path=teacher_dir),
            advantage_estimator="on_policy_distill",
            kl_coef=0.0,
            loss_agg_mode="token-mean",
            **kwargs,
        )[1]

    full = run(tmp_path / "full")
    run(tmp_path / "split", crash_after=1)
    checkpoint = checkpoint_path(tmp_path / "split" / "checkpoints", 1)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    assert any(k.startswith("actor.") for k in saved) and not [k for k in saved if k.startswith("teacher.")]
    resumed = run(tmp_path / "split", resume_from=checkpoint)
    assert resumed.rollout_step == full.rollout_step == 2 and resumed.teacher is not None
    keys = ("teacher/reverse_kl", "teacher/logprob_gap")
    assert [resumed.history[-1][k] for k in keys] == [full.history[-1][k] for k in keys]
    assert full.history[-1]["teacher/logprob_gap"] > 0.01
    assert_same_weights(resumed.actor.state_dict(), full.actor.state_dict())
