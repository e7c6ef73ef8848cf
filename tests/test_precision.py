"""Precision: resolved once (lit_ppo.precision), shown in the plan, and every offered precision trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lit_ppo import precision as prec
from lit_ppo.errors import ConfigError
from lit_ppo.plan import compute_plan
from tests.helpers import (
    FIXTURE_MODEL,
    ROOT,
    compose_config,
    compose_run_config,
    datamodule_on,
    fixture_run,
    rollout_step_rows,
)

AVX512_BF16_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_tile\n"
AVX2_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2\n"


@pytest.mark.parametrize("cpuinfo, native", [(AVX512_BF16_CPU, True), (AVX2_CPU, False), (None, False)])
def test_cpu_native_bf16_is_read_from_the_cpu_flags(tmp_path, monkeypatch, cpuinfo, native):
    monkeypatch.delenv(prec.NATIVE_BF16_ENV, raising=False)
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    assert prec.cpu_has_native_bf16(path) is native


@pytest.mark.parametrize("cpuinfo", [AVX512_BF16_CPU, AVX2_CPU])
@pytest.mark.parametrize("forced", ["0", "1"])
def test_the_environment_switch_overrides_the_cpu_flags_so_either_path_can_be_tested(
    tmp_path, monkeypatch, cpuinfo, forced
):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    monkeypatch.setenv(prec.NATIVE_BF16_ENV, forced)
    assert prec.cpu_has_native_bf16(path) is (forced == "1")
    assert prec.resolve_precision("auto", "cpu") == ("bf16-mixed" if forced == "1" else "32-true")


def test_a_misspelt_environment_switch_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(prec.NATIVE_BF16_ENV, "no")
    with pytest.raises(ConfigError, match=r"LIT_PPO_NATIVE_BF16='no' is not 0 or 1"):
        prec.cpu_has_native_bf16(tmp_path / "cpuinfo")


@pytest.mark.parametrize("native, expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_picks_bf16_mixed_only_where_bf16_is_native(monkeypatch, native, expected):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: native)
    assert prec.resolve_precision("auto", "cpu") == expected
    assert prec.resolve_rollout_dtype(expected, None) == ("bfloat16" if native else "float32")
    assert prec.resolve_rollout_dtype(expected, "float32") == "float32"  # an explicit rollout.dtype wins


def test_auto_on_gpus_planned_from_a_machine_without_one_assumes_bf16(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prec.resolve_precision("auto", "gpu") == "bf16-mixed"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_explicit_precisions_are_kept(precision):
    assert prec.resolve_precision(precision, "cpu") == precision


@pytest.mark.parametrize("precision, named", [("16-mixed", "bf16-mixed"), ("64-true", "auto"), (32, "32-true")])
def test_unsupported_precision_is_one_line(precision, named):
    with pytest.raises(ConfigError) as info:
        prec.resolve_precision(precision, "cpu")
    assert "\n" not in str(info.value) and "strategy.precision" in str(info.value) and named in str(info.value)


def test_the_plan_shows_the_resolved_precision_and_vllm_dtype(monkeypatch):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    plan = compute_plan(compose_run_config("strategy.accelerator=cpu"), 2000)
    assert (plan.models.precision, plan.models.rollout_dtype) == ("bf16-mixed", "bfloat16")
    table = plan.table()
    assert (
        "bf16-mixed" in table and "float32 weights and optimizer states, bf16 compute" in table and "bfloat16" in table
    )
    assert not plan.warnings
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    plan = compute_plan(compose_run_config("strategy.accelerator=cpu"), 2000)
    assert (plan.models.precision, plan.models.rollout_dtype) == ("32-true", "float32")


def test_every_strategy_config_defaults_to_auto():
    for name in ("single", "ddp", "fsdp"):
        assert compose_config(f"strategy={name}").strategy.precision == "auto"
    assert compose_config().rollout.dtype is None


def test_plan_warns_about_bf16_true_and_top_p():
    plan = compute_plan(compose_run_config("strategy.precision=bf16-true", "rollout.top_p=0.9"), 2000)
    assert len(plan.warnings) == 2
    assert "bf16-mixed" in plan.warnings[1] and "off-distribution" in plan.warnings[0]
    assert all("\n" not in w for w in plan.warnings)
    assert sum(line.startswith("warning: ") for line in plan.table().splitlines()) == 2


def test_the_engine_starts_in_the_plans_rollout_dtype(tiny_model_dir, arithmetic_files, monkeypatch):
    """rollout.dtype=null follows the precision: the engine is asked for bfloat16 under bf16-mixed."""
    from transformers import AutoTokenizer

    from lit_ppo.rollout import datamodule as dm
    from lit_ppo.rollout.prompts import load_prompts
    from tests.helpers import plan_of

    started = {}
    # The class the registry's colocated vLLM row starts (a stand-in that records its settings: no engine beside the
    # session's shared one).
    from lit_ppo.rollout import engine

    monkeypatch.setattr(engine, "VLLMEngine", lambda model_dir, **kwargs: started.update(kwargs) or object())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = load_prompts(arithmetic_files[0], tokenizer)
    for configured, expected in ((None, "bfloat16"), ("float32", "float32")):
        rollout = dm.RolloutConfig(dtype=configured)
        plan = plan_of(len(prompts), rollout=rollout, precision="bf16-mixed")
        datamodule = datamodule_on(prompts, rollout, tokenizer, tiny_model_dir, plan=plan)
        datamodule.start_engine()
        assert started["dtype"] == expected


# ---------------------------------------------------------------- every precision trains


# 32-true: every build_run test of make test trains in it; auto resolves to one of the others (test_auto_picks_...).
@pytest.mark.parametrize(
    "precision",
    [
        pytest.param("32-true", marks=pytest.mark.slow),
        "bf16-mixed",
        "bf16-true",
        pytest.param("auto", marks=pytest.mark.slow),
    ],
)
def test_every_precision_runs_two_rollout_steps_single(precision, engine, tmp_path):

    summary = fixture_run(
        engine, tmp_path, f"strategy.precision={precision}", "trainer.eval_every=0", "ppo.actor_lr=1e-3"
    )
    assert (
        summary["rollout_steps"] == 2 and summary["optimizer_steps_actor"] == summary["expected_optimizer_steps"] == 4
    )
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["models"]["precision"] == prec.resolve_precision(precision, "auto")
    rows = rollout_step_rows(tmp_path / "metrics.csv")
    assert all(math.isfinite(float(r["actor/policy_loss"])) for r in rows)
    assert float(rows[-1]["actor/skipped_updates"]) == 0


# ---------------------------------------------------------------- FSDP2, 2 CPU processes

FSDP_SETTINGS = [
    "strategy=fsdp",
    "strategy.devices=2",
    "strategy.accelerator=cpu",
    "trainer.total_rollout_steps=2",
    "trainer.checkpoint_every=1",
    "trainer.eval_every=0",
    "model.warm_start.enabled=false",
    "data.n_train=64",
    "data.n_eval=8",
    *FIXTURE_MODEL,
    # 6 prompts x 4 samples / 8 per update = 3 updates per rollout step, at the flagship's LR; the
    # entropy bonus gives every logit a gradient whatever the rewards.
    "ppo.rollout_batch_size=6",
    "ppo.train_batch_size=8",
    "ppo.micro_train_batch_size=4",
    "ppo.actor_lr=1e-6",
    "ppo.kl_coef=0",
    "ppo.entropy_coef=0.01",
    "reward.overlong_penalty=1.0",
]


@pytest.fixture(scope="module")
def fsdp_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp_cache")


def fsdp_run(out: Path, cache: Path, precision: str) -> Path:
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "train.py",
        *FSDP_SETTINGS,
        f"strategy.precision={precision}",
        f"output_dir={out}",
        f"cache_dir={cache}",
        f"hydra.run.dir={out / 'hydra'}",
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420, start_new_session=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def changed_fraction(cache: Path, run: Path) -> float:
    """Share of the actor's weight elements that differ from the initial model after rollout step 1 (3 updates)."""
    import torch
    from safetensors.torch import load_file

    (initial_dir,) = cache.glob("tiny-*")
    initial = load_file(initial_dir / "model.safetensors")
    state = torch.load(run / "checkpoints" / "rollout_step_000001.ckpt", weights_only=False)["state_dict"]
    changed = total = 0
    for name, before in initial.items():
        after = state[f"actor.{name}"]
        changed += int((before.to(after.dtype) != after).sum())
        total += after.numel()
    return changed / total


def check_fsdp_run(run: Path, precision: str) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["rollout_steps"] == 2 and summary["optimizer_steps_actor"] == summary["expected_optimizer_steps"] == 6
    )
    assert json.loads((run / "plan.json").read_text())["models"]["precision"] == prec.resolve_precision(
        precision, "cpu"
    )
    rows = rollout_step_rows(run / "metrics.csv")
    assert all(math.isfinite(float(r["actor/policy_loss"])) for r in rows)
    assert all(float(r["rollout/logprob_abs_diff"]) < 0.05 for r in rows)  # the engines follow the actor


# make test: test_fsdp2_bf16_mixed_on_a_one_rank_cpu_mesh_keeps_float32_master_weights_that_lr_1e6_moves (the same
# sharding through PPOModule.configure_model, in this process), and an FSDP train.py run in
# tests/end_to_end/test_ddp.py::test_two_processes_train_with_an_engine_per_rank[fsdp].
@pytest.mark.slow
def test_fsdp_bf16_mixed_keeps_float32_master_weights_that_lr_1e6_moves(tmp_path, fsdp_cache):
    """bf16 compute with float32 master weights under FSDP2: 3 AdamW updates at lr 1e-6 change >= 99 % of the
    actor's float32 weight elements (each moves by ~1e-6, far below bf16's resolution at |w| ~ 0.02)."""
    run = fsdp_run(tmp_path, fsdp_cache, "bf16-mixed")
    check_fsdp_run(run, "bf16-mixed")
    assert changed_fraction(fsdp_cache, run) >= 0.99


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "auto"])
def test_fsdp_runs_two_rollout_steps_in_every_precision(tmp_path, fsdp_cache, precision):
    run = fsdp_run(tmp_path, fsdp_cache, precision)
    check_fsdp_run(run, precision)
    fraction = changed_fraction(fsdp_cache, run)
    if precision == "bf16-true":  # the control: bf16 weights lose most of these updates (what the plan warns of)
        assert fraction < 0.5, fraction
    else:
        assert fraction >= 0.99, fraction


def test_fsdp2_bf16_mixed_on_a_one_rank_cpu_mesh_keeps_float32_master_weights_that_lr_1e6_moves(
    tiny_model_dir, tmp_path
):
    """The FSDP run's sharding at precision=bf16-mixed, in this process on a 1-rank gloo mesh: PPOModule's
    configure_model (as Lightning's ModelParallelStrategy calls it, with the trainer's precision and the data-parallel
    mesh) shards the actor into float32 DTensors whose layers compute in bf16, its AdamW states (the module's own
    optimizers) are float32, and 3 updates at lr 1e-6 change >= 99 % of the actor's weight elements: each moves by
    ~1e-6, far below bf16's resolution at |w| ~ 0.02. (tests/end_to_end/test_gpu.py checks the same on a GPU.)"""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from lit_ppo.config import PPOConfig
    from lit_ppo.training.module import PPOModule
    from tests.helpers import plan_of

    # An in-process vLLM engine of an earlier test (the session's `engine`) leaves its 1-rank gloo group up: use it.
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        torch.manual_seed(0)
        module = PPOModule(
            model_dir=tiny_model_dir,
            ppo=PPOConfig(actor_lr=1e-6, kl_coef=0.0),
            plan=plan_of(64, precision="bf16-mixed"),
            pad_token_id=0,
        )
        module._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
        module.trainer = SimpleNamespace(precision="bf16-mixed")  # what configure_model reads of the trainer
        module.configure_model()
        actor = module.actor
        assert module.sharded and all(isinstance(p, DTensor) for p in actor.parameters())
        assert {p.dtype for p in actor.parameters()} == {torch.float32}
        compute = set()
        actor.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, out: compute.add(out.dtype))
        before = {n: p.full_tensor().detach().clone() for n, p in actor.named_parameters()}
        optimizer = module.configure_optimizers()[0][0]  # the actor's
        ids = torch.randint(4, 40, (4, 32), generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            actor(input_ids=ids, labels=ids).loss.backward()  # next-token loss: a gradient for every parameter
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert compute == {torch.bfloat16}
        assert {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
        changed = sum(int((p.full_tensor() != before[n]).sum()) for n, p in actor.named_parameters())
        assert changed / sum(t.numel() for t in before.values()) >= 0.99
    finally:
        if own_group:
            dist.destroy_process_group()
    # The control: the same updates on weights stored in bf16 (precision=bf16-true) are mostly lost.
    control = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in control.named_parameters()}
    optimizer = torch.optim.AdamW(control.parameters(), lr=1e-6, weight_decay=0.0)
    for _ in range(3):
        control(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    changed = sum(int((p != before[n]).sum()) for n, p in control.named_parameters())
    assert changed / sum(t.numel() for t in before.values()) < 0.5
