"""Tests of the step plan (lit_ppo.plan) and of how `train.py` states it.

Expected numbers are written out by hand with their derivation in a comment, or come from the
independent formula of docs/reference.md section 1.1 (OpenRLHF): updates per rollout step =
rollout_batch_size x n_samples_per_prompt x ppo_epochs / train_batch_size.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from lit_ppo.config import PPOConfig, RolloutConfig, parse_section
from lit_ppo.errors import ConfigError, StepAccountingError
from lit_ppo.plan import compute_plan, sections_of
from lit_ppo.run import entry as run_module
from lit_ppo.training.state import check_same_adapters, check_same_models, check_same_rollout_step_shape
from tests.helpers import ROOT, compose_config, compose_run_config, plan_of
from tests.helpers.cli_runs import train_py

REPO = ROOT
CONF = REPO / "conf"
PLAN_KEYS = (  # (section, key) in plan.json
    ("counts", "rollout_steps_per_data_epoch"),
    ("counts", "total_rollout_steps"),
    ("counts", "optimizer_steps_per_rollout_step"),
    ("counts", "total_optimizer_steps"),
    ("layout", "grad_accumulation_steps"),
    ("counts", "data_epochs"),
)


def make_plan(ppo: dict | None = None, run: dict | None = None, dataset: int = 2000, dp: int = 1, tokens: int = 8):
    """compute_plan on a small valid base config (32 prompts x 4 samples, train batch 64, micro 16)."""
    base = dict(
        rollout_batch_size=32, n_samples_per_prompt=4, ppo_epochs=1, train_batch_size=64, micro_train_batch_size=16
    )
    base.update(ppo or {})
    length = dict(total_rollout_steps=10, data_epochs=None) if run is None else run
    return plan_of(
        dataset,
        ppo=PPOConfig(**base),
        steps=length["total_rollout_steps"],
        data_epochs=length["data_epochs"],
        dp=dp,
        rollout=RolloutConfig(max_response_tokens=tokens),
    )


# ---------------------------------------------------------------- docs/reference.md section 1 examples


def test_openrlhf_updates_per_rollout_step():
    # 256 prompts x 16 samples = 4096 samples; / 128 per update = 32 mini-batches; x 1 epoch = 32.
    plan = make_plan(
        dict(
            rollout_batch_size=256,
            n_samples_per_prompt=16,
            ppo_epochs=1,
            train_batch_size=128,
            micro_train_batch_size=8,
        ),
        dataset=2560,
    )
    assert plan.counts.samples_per_rollout_step == 4096
    assert plan.counts.mini_batches_per_ppo_epoch == 32
    assert plan.counts.optimizer_steps_per_rollout_step == 32
    assert plan.layout.grad_accumulation_steps == 16  # 128 samples / 8 per micro-batch on one rank
    assert plan.counts.total_optimizer_steps == 32 * plan.counts.total_rollout_steps


def test_simple_rl_step_is_a_rollout_step():
    # 8,532 prompts, rollout batch 1,024 prompts, mini-batch 256 prompts (x 8 samples = 2,048 samples),
    # one PPO epoch, 100 (rollout) steps.
    n = 8
    plan = make_plan(
        dict(
            rollout_batch_size=1024,
            n_samples_per_prompt=n,
            ppo_epochs=1,
            train_batch_size=256 * n,
            micro_train_batch_size=16,
        ),
        run=dict(total_rollout_steps=100, data_epochs=None),
        dataset=8532,
    )
    # The plan's definition: a data epoch is the full rollout batches that fit in the dataset
    # (8532 // 1024 = 8; the last 8532 - 8192 = 340 prompts are dropped and reshuffled), so
    # data_epochs = total_rollout_steps / rollout_steps_per_data_epoch = 100 / 8 = 12.5.
    assert plan.counts.rollout_steps_per_data_epoch == 8
    assert plan.counts.prompts_dropped_per_data_epoch == 340
    assert plan.counts.total_rollout_steps == 100
    assert plan.counts.data_epochs == pytest.approx(12.5)
    # Counting prompts instead: 100 x 1024 = 102,400 prompts consumed over 8,532 = 12.002 passes
    # (docs/reference.md section 1.2: 100 / (8532 / 1024); the source's "≈ 12" holds, its "11.7" = 100 / 8.532 is a slip).
    prompts_consumed = plan.counts.total_samples_generated / plan.counts.n_samples_per_prompt
    assert prompts_consumed == 102_400
    assert prompts_consumed / plan.counts.dataset_prompts == pytest.approx(100 * 1024 / 8532)
    assert round(prompts_consumed / plan.counts.dataset_prompts) == 12
    # Mini-batch of 256 prompts: 1024 / 256 = 4 updates per rollout step, 400 in all.
    assert plan.counts.optimizer_steps_per_rollout_step == 4
    assert plan.counts.total_optimizer_steps == 400
    assert plan.counts.lr_total_steps == 400  # the LR schedule runs in optimizer steps, not rollout steps


def test_simple_rl_misreading_steps_as_updates():
    # Reading "100 steps" as 100 optimizer steps: 100 / 4 = 25 rollout steps, about 3 passes over
    # the prompts (25 x 1024 / 8532 = 3.0), the misreading docs/reference.md section 1.2 warns against.
    n = 8
    plan = make_plan(
        dict(rollout_batch_size=1024, n_samples_per_prompt=n, train_batch_size=256 * n, micro_train_batch_size=16),
        run=dict(total_rollout_steps=25, data_epochs=None),
        dataset=8532,
    )
    assert plan.counts.total_optimizer_steps == 100
    assert plan.counts.total_samples_generated / n / plan.counts.dataset_prompts == pytest.approx(25 * 1024 / 8532)
    assert plan.counts.data_epochs == pytest.approx(25 / 8)


def test_simple_rl_run_length_in_data_epochs():
    # trainer.data_epochs=12.5 with 8 rollout steps per data epoch -> 100 rollout steps.
    n = 8
    plan = make_plan(
        dict(rollout_batch_size=1024, n_samples_per_prompt=n, train_batch_size=256 * n, micro_train_batch_size=16),
        run=dict(total_rollout_steps=None, data_epochs=12.5),
        dataset=8532,
    )
    assert plan.counts.total_rollout_steps == 100
    assert plan.counts.total_optimizer_steps == 400


def test_openai_baselines_sample_reuse():
    # N.T = 1024 samples per iteration (1024 prompts x 1 response), minibatch N.T/4 = 256,
    # K = 3 epochs: 4 mini-batches x 3 = 12 updates per iteration.
    plan = make_plan(
        dict(
            rollout_batch_size=1024,
            n_samples_per_prompt=1,
            ppo_epochs=3,
            train_batch_size=256,
            micro_train_batch_size=64,
        ),
        dataset=1024,
    )
    assert plan.counts.samples_per_rollout_step == 1024
    assert plan.counts.mini_batches_per_ppo_epoch == 4
    assert plan.counts.optimizer_steps_per_rollout_step == 12
    # K = 1 with a single minibatch of all N.T samples: one update, fully on-policy.
    on_policy = make_plan(
        dict(
            rollout_batch_size=1024,
            n_samples_per_prompt=1,
            ppo_epochs=1,
            train_batch_size=1024,
            micro_train_batch_size=64,
        ),
        dataset=1024,
    )
    assert on_policy.counts.optimizer_steps_per_rollout_step == 1


@pytest.mark.parametrize(
    "rollout, n, epochs, train, micro",
    [(32, 4, 1, 64, 16), (32, 4, 2, 64, 16), (32, 4, 4, 32, 8), (64, 8, 3, 128, 32), (16, 2, 2, 32, 32)],
)
def test_updates_formula(rollout, n, epochs, train, micro):
    plan = make_plan(
        dict(
            rollout_batch_size=rollout,
            n_samples_per_prompt=n,
            ppo_epochs=epochs,
            train_batch_size=train,
            micro_train_batch_size=micro,
        ),
        run=dict(total_rollout_steps=7, data_epochs=None),
    )
    assert plan.counts.optimizer_steps_per_rollout_step == rollout * n * epochs // train
    assert plan.counts.total_optimizer_steps == 7 * rollout * n * epochs // train
    assert plan.layout.grad_accumulation_steps == train // micro


def test_ppo_epochs_takes_effect():
    # The verl bug of docs/reference.md section 1.4: ppo_epochs silently ignored. Here it must scale the updates.
    one = make_plan(dict(ppo_epochs=1))
    three = make_plan(dict(ppo_epochs=3))
    assert three.counts.optimizer_steps_per_rollout_step == 3 * one.counts.optimizer_steps_per_rollout_step
    assert three.counts.total_optimizer_steps == 3 * one.counts.total_optimizer_steps


def test_data_epochs_round_up_to_whole_rollout_steps():
    # 2000 // 32 = 62 rollout steps per data epoch; 0.5 data epochs = 31; 0.51 -> ceil(31.62) = 32.
    assert make_plan(run=dict(total_rollout_steps=None, data_epochs=0.5)).counts.total_rollout_steps == 31
    plan = make_plan(run=dict(total_rollout_steps=None, data_epochs=0.51))
    assert plan.counts.total_rollout_steps == 32
    assert plan.counts.data_epochs == pytest.approx(32 / 62)


def test_table_and_json_carry_the_numbers():
    plan = make_plan()
    table = plan.table()
    assert "optimizer steps per rollout step" in table and "rollout steps per data epoch" in table
    data = json.loads(plan.to_json())
    for section, key in PLAN_KEYS:
        assert data[section][key] == getattr(getattr(plan, section), key)


# ---------------------------------------------------------------- inconsistent configurations

BAD_CONFIGS = [
    # id, kwargs of make_plan, key names the message must contain
    (
        "samples_not_multiple_of_train_batch",
        dict(ppo=dict(train_batch_size=48)),
        ["ppo.train_batch_size", "ppo.rollout_batch_size", "ppo.n_samples_per_prompt"],
    ),
    (
        "train_batch_not_multiple_of_micro",
        dict(ppo=dict(micro_train_batch_size=24)),
        ["ppo.train_batch_size", "ppo.micro_train_batch_size"],
    ),
    (
        "train_batch_not_multiple_of_micro_x_ranks",
        dict(ppo=dict(micro_train_batch_size=16), dp=8),
        ["ppo.train_batch_size", "ppo.micro_train_batch_size"],
    ),
    ("rollout_batch_larger_than_dataset", dict(dataset=16), ["ppo.rollout_batch_size"]),
    (
        "rollout_batch_not_divisible_by_ranks",
        dict(
            ppo=dict(rollout_batch_size=32, n_samples_per_prompt=3, train_batch_size=48, micro_train_batch_size=16),
            dp=3,
        ),
        ["ppo.rollout_batch_size"],
    ),
    ("zero_rollout_batch_size", dict(ppo=dict(rollout_batch_size=0)), ["ppo.rollout_batch_size"]),
    ("negative_n_samples", dict(ppo=dict(n_samples_per_prompt=-4)), ["ppo.n_samples_per_prompt"]),
    ("zero_ppo_epochs", dict(ppo=dict(ppo_epochs=0)), ["ppo.ppo_epochs"]),
    ("zero_train_batch_size", dict(ppo=dict(train_batch_size=0)), ["ppo.train_batch_size"]),
    ("negative_micro_batch", dict(ppo=dict(micro_train_batch_size=-16)), ["ppo.micro_train_batch_size"]),
    ("bool_rollout_batch_size", dict(ppo=dict(rollout_batch_size=True)), ["ppo.rollout_batch_size"]),
    ("float_train_batch_size", dict(ppo=dict(train_batch_size=64.0)), ["ppo.train_batch_size"]),
    (
        "zero_total_rollout_steps",
        dict(run=dict(total_rollout_steps=0, data_epochs=None)),
        ["trainer.total_rollout_steps"],
    ),
    ("negative_data_epochs", dict(run=dict(total_rollout_steps=None, data_epochs=-1.0)), ["trainer.data_epochs"]),
    ("zero_data_parallel_size", dict(dp=0), ["strategy.devices"]),
    ("empty_dataset", dict(dataset=0), ["data"]),
    (
        "both_run_lengths",
        dict(run=dict(total_rollout_steps=10, data_epochs=1.0)),
        ["trainer.total_rollout_steps", "trainer.data_epochs"],
    ),
    (
        "neither_run_length",
        dict(run=dict(total_rollout_steps=None, data_epochs=None)),
        ["trainer.total_rollout_steps", "trainer.data_epochs"],
    ),
    ("unknown_advantage_estimator", dict(ppo=dict(advantage_estimator="ppo2")), ["ppo.advantage_estimator"]),
    *[
        (
            f"{est}_with_one_sample",
            dict(ppo=dict(advantage_estimator=est, n_samples_per_prompt=1, train_batch_size=32)),
            ["ppo.advantage_estimator", "ppo.n_samples_per_prompt"],
        )
        for est in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
    ],
    ("bad_kl_estimator", dict(ppo=dict(kl_estimator="k4")), ["ppo.kl_estimator"]),
    ("bad_kl_mode", dict(ppo=dict(kl_mode="advantage")), ["ppo.kl_mode"]),
    *[
        (
            f"{est}_with_kl_in_the_reward",
            dict(ppo=dict(advantage_estimator=est, kl_mode="reward", kl_coef=0.01)),
            ["ppo.advantage_estimator", "ppo.kl_mode=loss"],
        )
        for est in ("grpo", "dr_grpo", "rloo")
    ],
    ("negative_kl_coef", dict(ppo=dict(kl_coef=-0.1)), ["ppo.kl_coef"]),
    ("bad_loss_agg_mode", dict(ppo=dict(loss_agg_mode="sum")), ["ppo.loss_agg_mode"]),
    ("dual_clip_equal_1", dict(ppo=dict(dual_clip=1.0)), ["ppo.dual_clip"]),
    ("dual_clip_below_1", dict(ppo=dict(dual_clip=0.5)), ["ppo.dual_clip"]),
    ("clip_ratio_low_ge_1", dict(ppo=dict(clip_ratio_low=1.0)), ["ppo.clip_ratio_low"]),
    ("bad_lr_schedule", dict(ppo=dict(lr_schedule="linear")), ["ppo.lr_schedule"]),
    ("warmup_ratio_1", dict(ppo=dict(lr_warmup_ratio=1.0)), ["ppo.lr_warmup_ratio"]),
    ("zero_actor_lr", dict(ppo=dict(actor_lr=0.0)), ["ppo.actor_lr"]),
]


def assert_one_line_naming(error: ConfigError, keys: list[str]) -> None:
    message = str(error)
    assert "\n" not in message, message
    for key in keys:
        assert key in message, f"{key!r} not named in: {message}"


@pytest.mark.parametrize("kwargs, keys", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_inconsistent_config_raises(kwargs, keys):
    with pytest.raises(ConfigError) as info:
        make_plan(**kwargs)
    assert_one_line_naming(info.value, keys)


def test_unknown_ppo_key_is_refused():
    with pytest.raises(ConfigError) as info:
        parse_section(PPOConfig, {"rollout_batch_size": 32, "rollout_batchsize": 32}, "ppo")
    assert_one_line_naming(info.value, ["ppo.rollout_batchsize"])


def test_known_ppo_keys_are_accepted():
    ppo = parse_section(PPOConfig, {"rollout_batch_size": 8, "ppo_epochs": 2}, "ppo")
    assert (ppo.rollout_batch_size, ppo.ppo_epochs) == (8, 2)


# ---------------------------------------------------------------- through the Hydra configs


def test_hydra_plan_mode_default_config(tmp_path, capsys):
    cfg = compose_config("mode=plan", f"output_dir={tmp_path}")
    assert run_module.main(cfg) is None
    plan = json.loads((tmp_path / "plan.json").read_text())
    # conf defaults: 2000 arithmetic prompts, rollout 32 x 4 samples, train batch 64, micro 32, 30 rollout steps.
    assert plan["counts"]["rollout_steps_per_data_epoch"] == 62  # 2000 // 32
    assert plan["counts"]["total_rollout_steps"] == 30
    assert plan["counts"]["optimizer_steps_per_rollout_step"] == 2  # 128 / 64
    assert plan["counts"]["total_optimizer_steps"] == 60
    assert plan["layout"]["grad_accumulation_steps"] == 2  # 64 / 32
    assert plan["counts"]["data_epochs"] == pytest.approx(30 / 62)
    assert "plan written to" in capsys.readouterr().out


def test_hydra_plan_mode_with_overrides(tmp_path):
    cfg = compose_config(
        "mode=plan",
        f"output_dir={tmp_path}",
        "ppo.ppo_epochs=3",
        "strategy=ddp",
        "strategy.devices=2",
        "trainer.total_rollout_steps=null",
        "trainer.data_epochs=2",
    )
    run_module.main(cfg)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["counts"]["rollout_steps_per_data_epoch"] == 62
    assert plan["counts"]["total_rollout_steps"] == 124  # 2 x 62
    assert plan["counts"]["data_epochs"] == pytest.approx(2.0)
    assert plan["counts"]["optimizer_steps_per_rollout_step"] == 6  # 2 mini-batches x 3 epochs
    assert plan["counts"]["total_optimizer_steps"] == 744  # 6 x 124
    assert plan["layout"]["grad_accumulation_steps"] == 1  # 64 / (32 micro x 2 ranks)
    assert plan["counts"]["data_parallel_size"] == 2


def test_hydra_train_mode_reaches_training_when_valid(tmp_path, no_training):
    # Shows the `no_training` guard intercepts the run: the bad-config tests below rely on it.
    cfg = compose_config("mode=train", f"output_dir={tmp_path}")
    assert run_module.main(cfg) == {"fake": True}
    assert no_training == [tmp_path]


BAD_OVERRIDES = [
    ("train_batch_7", ["ppo.train_batch_size=7"], ["ppo.train_batch_size"]),
    (
        "rollout_batch_over_dataset",
        ["ppo.rollout_batch_size=4096", "ppo.train_batch_size=128"],
        ["ppo.rollout_batch_size"],
    ),
    ("both_run_lengths", ["trainer.data_epochs=1"], ["trainer.total_rollout_steps", "trainer.data_epochs"]),
    ("unknown_ppo_key", ["+ppo.rollout_batchsize=16"], ["ppo.rollout_batchsize"]),
    ("grpo_one_sample", ["ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=1"], ["ppo.n_samples_per_prompt"]),
    ("micro_x_ranks", ["strategy=ddp", "strategy.devices=4"], ["ppo.micro_train_batch_size"]),
    ("single_with_ranks", ["strategy.devices=2"], ["strategy=single", "fix: strategy=ddp strategy.devices=2"]),
    ("bad_mode", ["mode=dry"], ["mode"]),
    # Misspelled keys in every group (Hydra tells the user to add `+`; then the typed settings refuse them).
    ("unknown_reward_key", ["+reward.timeout=5"], ["reward.timeout", "did you mean reward.timeout_s"]),
    ("unknown_trainer_key", ["+trainer.total_rolout_steps=5"], ["trainer.total_rolout_steps", "total_rollout_steps"]),
    ("unknown_model_key", ["+model.gradient_checkpoint=true"], ["model.gradient_checkpoint", "gradient_checkpointing"]),
    ("unknown_data_key", ["+data.max_prompt_len=64"], ["data.max_prompt_len"]),
    ("unknown_strategy_key", ["+strategy.gpus=2"], ["strategy.gpus"]),
    ("unknown_tiny_key", ["+model.tiny.layers=2"], ["model.tiny.layers"]),
    ("unknown_rollout_key", ["+rollout.temprature=0.7"], ["rollout.temprature", "rollout.temperature"]),
    ("unknown_root_key", ["+sed=1"], ["sed", "seed"]),
    ("unset_data_path", ["data=file"], ["data.path", "not set"]),
    (  # data.expected_prompts plans a missing file in mode=plan only: a training run reached the trainer without data
        "missing_data_path_with_expected_prompts",
        ["data=file", "data.path=/nonexistent/train.jsonl", "data.expected_prompts=64"],
        ["data.path=/nonexistent/train.jsonl does not exist", "mode=plan only"],
    ),
]


@pytest.mark.parametrize("overrides, keys", [c[1:] for c in BAD_OVERRIDES], ids=[c[0] for c in BAD_OVERRIDES])
def test_hydra_bad_override_fails_before_training(tmp_path, no_training, overrides, keys):
    cfg = compose_config("mode=train", f"output_dir={tmp_path / 'out'}", *overrides)
    with pytest.raises(ConfigError) as info:
        run_module.main(cfg)
    assert_one_line_naming(info.value, keys)
    assert no_training == []
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the command line


def test_cli_plan_mode(tmp_path):
    out = tmp_path / "run"
    proc = train_py(tmp_path, "mode=plan", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((out / "plan.json").read_text())
    for section, key in PLAN_KEYS:
        assert key in plan[section]
    assert "optimizer steps per rollout step" in proc.stdout


def test_cli_old_flat_rollout_keys_still_plan_and_are_announced_once(tmp_path):
    """`rollout.worker_launch=...` of the last release: train.py writes it as rollout.workers.launch and says so in
    one line; the plan is the one of the new keys."""
    out = tmp_path / "run"
    old = (
        "rollout.mode=disaggregated",
        "rollout.worker_launch=external",
        "rollout.trainer_host=node7",
        "rollout.kv_cache_gib=2",  # an engine's own setting, now in its section (rollout.vllm)
    )
    proc = train_py(tmp_path, "mode=plan", *old, f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    moved = [line for line in proc.stderr.splitlines() if " moved to " in line]
    assert moved == [
        "warning: rollout.worker_launch moved to rollout.workers.launch; the old key works for this release only "
        "(fix: write rollout.workers.launch)",
        "warning: rollout.trainer_host moved to rollout.workers.trainer_host; the old key works for this release only "
        "(fix: write rollout.workers.trainer_host)",
        "warning: rollout.kv_cache_gib moved to rollout.vllm.kv_cache_gib; the old key works for this release only "
        "(fix: write rollout.vllm.kv_cache_gib)",
    ]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["workers"]["launch"] == "external" and plan["workers"]["address"] == "node7:29600"
    (kv,) = [row for row in plan["memory"]["worker_rows"] if row["what"] == "vLLM KV cache (CPU)"]
    assert kv["bytes"] == 2 * 2**30 and kv["how"] == "rollout.vllm.kv_cache_gib"


def test_cli_an_old_rollout_key_and_its_new_key_with_two_values_stop_in_one_line(tmp_path):
    """`rollout.worker_launch=server rollout.workers.launch=external`: refused in one line, exit 2, before Hydra
    composes anything (Hydra would keep the later silently; issue 55 item 3)."""
    out = tmp_path / "run"
    proc = train_py(
        tmp_path, "mode=plan", "rollout.worker_launch=server", "rollout.workers.launch=external", f"output_dir={out}"
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("warning: ")]
    assert errors == [
        "error: rollout.worker_launch=server and rollout.workers.launch=external give rollout.workers.launch two "
        "values (rollout.worker_launch is its old key); fix: give it once, as rollout.workers.launch=<value>"
    ]
    assert not out.exists()


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    out = tmp_path / "run"
    proc = train_py(tmp_path, "mode=plan", "ppo.train_batch_size=7", f"output_dir={out}")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "ppo.train_batch_size" in errors[0]
    assert not (out / "plan.json").exists()


# Runs train.py as `python train.py ARGS` would, then records at exit which heavy libraries the process imported.
RECORD_IMPORTS_THEN_RUN_TRAIN_PY = """
import atexit, json, runpy, sys

out = sys.argv[1]

def record():
    torch = sys.modules.get("torch")
    facts = {
        "imported": {name: name in sys.modules for name in ("vllm", "transformers")},
        "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized()),
    }
    with open(out, "w") as f:
        json.dump(facts, f)

atexit.register(record)
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize(
    "experiment,prompts,updates",
    [
        ("qwen7b", 8532, 4),  # the process imports neither vLLM nor transformers: one experiment shows it
        pytest.param("qwen1.5b", 8532, 4, marks=pytest.mark.slow),  # counts: test_conf_discovery, test_memory
        pytest.param("qwen0.5b", 8532, 4, marks=pytest.mark.slow),
    ],
)
def test_real_experiments_plan_without_weights_or_gpu(experiment, prompts, updates, tmp_path):
    """`python train.py +experiment=<name> mode=plan` on a machine with no GPU, no weights and no data."""
    seen = tmp_path / "modules.json"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            RECORD_IMPORTS_THEN_RUN_TRAIN_PY,
            str(seen),
            f"+experiment={experiment}",
            "mode=plan",
            f"output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["counts"]["dataset_prompts"] == prompts
    assert plan["counts"]["optimizer_steps_per_rollout_step"] == updates
    assert plan["counts"]["total_rollout_steps"] == 100 and plan["counts"]["total_optimizer_steps"] == 100 * updates
    # Plan mode imports torch (the memory estimate uses its dtypes), but it must build no model, load no weights
    # and start no engine: none of the libraries that do so is imported, and CUDA is never initialised.
    after = json.loads(seen.read_text())
    assert after["imported"] == {"vllm": False, "transformers": False}
    assert after["cuda_initialized"] is False


@pytest.mark.parametrize(
    "experiment,prompts,turns,budget", [("gsm8k_tools", 7473, 4, 2048), ("tool_arithmetic", 4000, 3, 40)]
)
def test_episode_experiments_plan_turns_and_token_budget(experiment, prompts, turns, budget, tmp_path, capsys):
    """The plan of a multi-turn experiment counts episodes as samples and shows max_turns and the token budget,
    which is the response width planned for (`mode=plan`: no weights, no data, no GPU; in this process: the plan
    mode's process is test_real_experiments_plan_without_weights_or_gpu's)."""
    run_module.main(compose_config(f"+experiment={experiment}", "mode=plan", f"output_dir={tmp_path}"))
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["counts"]["dataset_prompts"] == prompts
    assert (
        plan["episodes"]["max_turns"] == turns
        and plan["episodes"]["max_episode_tokens"] == budget == plan["counts"]["max_response_tokens"]
    )
    assert plan["counts"]["max_tokens_generated"] == plan["counts"]["total_samples_generated"] * budget
    # The one rendering the plan table has: name, right-aligned value, unit (lit_ppo.plan.StepPlan.table).
    lines = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    turns_row = rf"episode: policy turns +{turns}  turns / episode at most \(one vLLM call each\)"
    budget_row = rf"episode: token budget +{budget}  response tokens / episode at most \(turns \+ observations\)"
    assert re.fullmatch(turns_row, lines["episode: policy turns"])
    assert re.fullmatch(budget_row, lines["episode: token budget"])


def test_max_turns_needs_an_environment(tmp_path):
    with pytest.raises(ConfigError, match="rollout.episodes.max_turns=3 without rollout.episodes.environment"):
        run_module.main(compose_config("rollout.episodes.max_turns=3", "mode=plan", f"output_dir={tmp_path}"))


# ---------------------------------------------------------------- the plan in sections; plans written before them


def test_a_feature_that_is_off_has_no_section_and_no_rows():
    plain = compute_plan(compose_run_config(), 2000)
    assert (plain.dynamic_sampling, plain.episodes, plain.lora, plain.workers) == (None, None, None, None)
    table = plain.table()
    assert "dynamic sampling" not in table and "LoRA" not in table and "rollout mode" not in table
    on = compute_plan(compose_run_config("ppo=dapo", "model.lora.rank=8"), 2000)
    assert on.dynamic_sampling.max_generation_rounds == 3 and on.lora.rank == 8 and on.lora.vllm_max_lora_rank == 8
    assert "dynamic sampling: rounds" in on.table() and "LoRA" in on.table()
    record = on.to_dict()
    assert record["lora"]["rank"] == 8 and record["workers"] is None and record["counts"]["total_rollout_steps"] == 30


FLAT_V1 = REPO / "tests" / "fixtures" / "plan_flat_lora_v1.json"  # a plan.json written before the plan had sections


def test_a_flat_plan_of_an_old_checkpoint_maps_to_the_sections():
    """tests/fixtures/plan_flat_lora_v1.json is the flat plan.json of `python train.py mode=plan model.lora.rank=8`
    written before the sections (bench/plan_tables.py): mapped by `sections_of`, it is this version's plan of the same
    config from the same pre-flight (prompt lengths, LoRA targets matched on the tiny model), value for value."""
    flat = json.loads(FLAT_V1.read_text())
    from lit_ppo.run.prepare import preflight

    checked = preflight(compose_run_config("model.lora.rank=8", "mode=plan"))
    now = compute_plan(checked.config, 2000, checked.prompt_stats, checked.lora_targets).to_dict()
    newer = {
        "shared_prefix",
        "expected_prefix_tokens_saved_per_micro_batch",
        "row_tokens",
        "expected_row_padding_tokens_per_micro_batch",
        "sequence_length_divisor",
        "tokens_per_rank_per_micro_batch",
    }
    assert now["layout"].keys() >= newer
    now["layout"] = {k: v for k, v in now["layout"].items() if k not in newer}
    mapped = sections_of(flat)
    # precision: auto follows the machine: the fixture was written where bf16 is native (bf16-mixed, a bf16 engine)
    assert (mapped["models"]["precision"], mapped["models"]["rollout_dtype"]) == ("bf16-mixed", "bfloat16")
    for plan in (mapped, now):
        plan["models"] = {k: v for k, v in plan["models"].items() if k not in ("precision", "rollout_dtype")}
    assert mapped == now
    assert sections_of(now) is now  # a plan with sections is read as it is


def test_a_resumed_run_checks_an_old_flat_plan_by_its_sections():
    """The checkpoint's plan comparison (checkpoints.py) reads a flat plan of an older checkpoint: the same models,
    adapters and rollout-step shape pass; another adapter rank or train batch is refused in one line."""
    flat = json.loads(FLAT_V1.read_text())
    same = compute_plan(compose_run_config("model.lora.rank=8"), 2000)
    check_same_models(flat, same)
    check_same_adapters(flat, same)
    check_same_rollout_step_shape(flat, same)
    with pytest.raises(ConfigError, match=r"adapters \{'rank': 8.*this run trains \{'rank': 16"):
        check_same_adapters(flat, compute_plan(compose_run_config("model.lora.rank=16"), 2000))
    with pytest.raises(ConfigError, match=r"adapters \{'rank': 8.*this run trains \{'rank': 0"):
        check_same_adapters(flat, compute_plan(compose_run_config(), 2000))
    with pytest.raises(StepAccountingError, match="another plan"):
        check_same_rollout_step_shape(flat, compute_plan(compose_run_config("ppo.train_batch_size=32"), 2000))
    with pytest.raises(ConfigError, match="another algorithm"):
        check_same_models(flat, compute_plan(compose_run_config("ppo=grpo"), 2000))
    # and a plan with sections, as this version writes it into a checkpoint
    check_same_adapters(same.to_dict(), same)
    check_same_rollout_step_shape(same.to_dict(), same)


def test_a_run_directory_of_the_last_release_resumes_under_the_nested_rollout_keys(tmp_path, capsys):
    """Its config.yaml holds the flat rollout keys (rollout.worker_launch, rollout.max_turns, ...): read through
    config.MOVED_KEYS they equal this run's nested ones, so the resume is allowed, silently (the run wrote them, not
    the user); a moved key whose value differs is still refused, by its new name."""
    import dataclasses

    import yaml

    from lit_ppo.config import MOVED_KEYS, MOVED_SECTIONS
    from lit_ppo.resume import check_run_directory
    from tests.helpers.resume import write_checkpoint

    def written_by_the_last_release(config) -> dict:
        values = config.to_dict()
        rollout = {k: v for k, v in values["rollout"].items() if k not in MOVED_SECTIONS}
        for old, new in MOVED_KEYS.items():
            section, name = new.split(".")[1:]
            rollout[old.split(".")[1]] = values["rollout"][section][name]
        return {**values, "rollout": rollout}

    config = compose_run_config("resume=auto", f"output_dir={tmp_path}")
    write_checkpoint(tmp_path / "checkpoints" / "rollout_step_000002.ckpt")
    saved = written_by_the_last_release(config)
    assert "worker_launch" in saved["rollout"] and "episodes" not in saved["rollout"]
    assert "kv_cache_gib" in saved["rollout"] and "vllm" not in saved["rollout"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    check_run_directory(config, tmp_path)
    assert " moved to " not in capsys.readouterr().err
    other = dataclasses.replace(
        config,
        rollout=dataclasses.replace(
            config.rollout, episodes=dataclasses.replace(config.rollout.episodes, environment_timeout_s=30.0)
        ),
    )
    with pytest.raises(
        ConfigError, match=r"another config \(rollout\.episodes\.environment_timeout_s: 60\.0 -> 30\.0\)"
    ):
        check_run_directory(other, tmp_path)


# Each experiment's and each feature's table, as committed in tests/fixtures/plan_tables/ (regenerated with
# LIT_PPO_WRITE_GOLDEN=1 when a change to the table is meant): a change to the plan's code that moves a row, a unit or
# a number fails here. Made from the config alone (no pre-flight: no tokenizer, no data file) with strategy.precision
# auto pinned to bf16-mixed, so that the table is the same on every machine.
GOLDEN = REPO / "tests" / "fixtures" / "plan_tables"
GOLDEN_CASES = {
    **{f"experiment_{p.stem}": [f"+experiment={p.stem}"] for p in sorted((CONF / "experiment").glob("*.yaml"))},
    "default": [],
    "disaggregated_k2_workers2": ["rollout.mode=disaggregated", "rollout.max_staleness=2", "rollout.workers.count=2"],
    "disaggregated_external_lora": [
        "rollout.mode=disaggregated",
        "rollout.workers.launch=external",
        "rollout.workers.trainer_host=node7",
        "model.lora.rank=8",
    ],
    "dapo_ddp": ["ppo=dapo", "strategy=ddp", "strategy.devices=2"],
    "dapo_disaggregated": ["ppo=dapo", "rollout.mode=disaggregated"],
    "packing_off_token_budget": ["ppo.packing=false", "ppo.micro_train_max_tokens=256"],
    "hf_engine_top_p": ["rollout.engine=hf", "rollout.vllm.kv_cache_gib=2", "rollout.top_p=0.9"],
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_the_table_of_each_experiment_is_its_golden_file(case):
    import os

    config = compose_run_config(*GOLDEN_CASES[case])
    if config.strategy.precision == "auto":
        config = compose_run_config(*GOLDEN_CASES[case], "strategy.precision=bf16-mixed")
    table = compute_plan(config, config.data.expected_prompts or config.data.n_train).table()
    path = GOLDEN / f"{case}.txt"
    if os.environ.get("LIT_PPO_WRITE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table + "\n")
    assert table + "\n" == path.read_text(), f"the plan table of {case} changed; see {path}"


def test_the_plan_states_context_parallelism():
    """strategy=ddp on 2 ranks with context_parallel_size=2: one data-parallel rank, C = 2 in the table, each rank's
    tokens per micro-batch (8 rows of 128 positions, 64 of each per rank), the sequence-length divisor, every rank in
    the gradient scale (Counts.ranks), and the shared prefix (null: on where it can be) on, as with one rank."""
    import dataclasses

    from lit_ppo.config import PPOConfig, StrategyConfig
    from lit_ppo.plan import compute_plan
    from tests.helpers import run_config

    ppo = PPOConfig(rollout_batch_size=4, n_samples_per_prompt=4, train_batch_size=16, micro_train_batch_size=8)
    strategy = StrategyConfig(name="ddp", accelerator="cpu", devices=2, precision="32-true", context_parallel_size=2)
    plan = compute_plan(dataclasses.replace(run_config(ppo=ppo), strategy=strategy), 64)
    assert (plan.counts.data_parallel_size, plan.counts.context_parallel_size, plan.counts.ranks) == (1, 2, 2)
    assert plan.layout.tokens_per_rank_per_micro_batch == 8 * 64 and plan.layout.sequence_length_divisor == 2
    assert plan.layout.shared_prefix and plan.layout.packing
    table = plan.table()
    for row in ("context-parallel size                      2", "tokens per rank                          512"):
        assert row in table, table
    assert "sequence-length divisor" in table
    one = compute_plan(run_config(ppo=ppo), 64)
    assert "context-parallel" not in one.table() and one.layout.shared_prefix and one.counts.ranks == 1
