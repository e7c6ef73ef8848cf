"""`train.py` through Hydra with the real vLLM engine: output files, presets, and the final actor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, fixture_run, read_csv

# The tiny architecture of the shared `engine` fixture, so in-process runs can reuse that engine.
SUMMARY_KEYS = [
    "rollout_steps",
    "optimizer_steps_actor",
    "optimizer_steps_critic",
    "expected_optimizer_steps",
    "samples_generated",
    "tokens_generated",
    "eval_reward_initial",
    "eval_reward_final",
    "wall_seconds",
    "generate_seconds",
    "experience_seconds",
    "train_seconds",
    "weight_sync_seconds",
]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> Path:
    """`python train.py` for two rollout steps, as a user runs it (its own process and vLLM engine)."""
    out = tmp_path_factory.mktemp("cli_run")
    cmd = [
        sys.executable,
        "train.py",
        "trainer.total_rollout_steps=2",
        "trainer.eval_every=1",
        "model.warm_start.steps=20",
        "data.n_train=128",
        "data.n_eval=16",
        f"output_dir={out}",
        f"cache_dir={out / 'cache'}",
        f"hydra.run.dir={out / 'hydra'}",
    ]
    result = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    (out / "console.txt").write_text(result.stdout)  # what the user sees, stdout and stderr as a terminal shows them
    assert result.returncode == 0, result.stdout[-4000:]
    return out


def test_console_shows_only_our_output_and_run_log_has_it(cli_run):
    """The console: plan, one progress bar, eval samples, the finish line; the rest is in logs/run.log."""
    console = (cli_run / "console.txt").read_text()
    # tqdm redraws its bar with carriage returns; everything else is a line of its own.
    lines = [line for line in console.replace("\r", "\n").splitlines() if line.strip()]
    others = [line for line in lines if not line.startswith("rollout steps:")]
    for word in ("WARNING", "Failed", "MISSING", "FutureWarning", "Warning", "INFO"):
        assert not [line for line in others if word in line], (word, console[-3000:])
    assert len(others) < 70, console  # the plan is most of it (~45 rows); a flood of library output is hundreds
    assert "Step plan" in console and "eval samples at rollout step 0" in console and "run finished" in console
    assert "critic: the policy's weights with a new value head" in console  # once, in our words
    table_rows = {"reward  prompt  response"}  # the eval samples' header repeats per evaluation
    counts = {
        line: others.count(line)
        for line in others
        if line not in table_rows and not line[:4].replace(".", "").isdigit()
    }
    assert all(n == 1 for n in counts.values()), {line: n for line, n in counts.items() if n > 1}
    run_log = (cli_run / "logs" / "run.log").read_text()
    for line in others:
        assert line.rstrip() in run_log, line
    # Other libraries' records are there, in the one format: time, level, logger, message.
    assert "INFO lightning" in run_log and "vllm" in run_log and "LOAD REPORT" in run_log


def test_cli_run_writes_every_output_file(cli_run):
    summary = json.loads((cli_run / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert key in summary, key
    assert summary["rollout_steps"] == 2
    # 32 prompts x 4 samples / 64 per update x 1 epoch = 2 updates per rollout step, for each optimizer.
    assert (
        summary["optimizer_steps_actor"]
        == summary["optimizer_steps_critic"]
        == summary["expected_optimizer_steps"]
        == 4
    )
    assert summary["samples_generated"] == 2 * 32 * 4
    assert 0 < summary["tokens_generated"] <= 2 * 32 * 4 * 8
    assert 0.0 <= summary["eval_reward_initial"] <= 1.0 and 0.0 <= summary["eval_reward_final"] <= 1.0
    rows = read_csv(cli_run / "metrics.csv")
    assert [int(float(r["rollout_step"])) for r in rows] == [0, 1, 2]  # 0: the evaluation before any update
    assert [int(float(r["optimizer_step"])) for r in rows] == [0, 2, 4]
    assert float(rows[0]["eval/reward"]) == pytest.approx(summary["eval_reward_initial"])
    assert rows[0]["rollout/reward_mean"] == ""
    assert {
        "data_epoch",
        "samples_seen",
        "rollout/reward_mean",
        "actor/policy_loss",
        "critic/value_loss",
        "timing/generate_s",
        "timing/weight_sync_s",
        "eval/reward",
    } <= set(rows[0])
    plan = json.loads((cli_run / "plan.json").read_text())
    assert plan["counts"]["total_optimizer_steps"] == 4
    assert (cli_run / "curves.png").stat().st_size > 10_000
    checkpoint = torch.load(cli_run / "checkpoints" / "rollout_step_000002.ckpt", weights_only=False)
    assert checkpoint["lit_ppo"]["rollout_step"] == 2 and checkpoint["lit_ppo"]["actor_optimizer_steps"] == 4


def test_final_actor_loads_in_transformers_and_vllm(cli_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_ppo.contract import GenerateRequest
    from lit_ppo.rollout.engine import VLLMEngine

    actor = AutoModelForCausalLM.from_pretrained(cli_run / "actor")
    assert actor.config.model_type == "qwen2"
    # vLLM in this process, beside any engine it holds (tests/rollout/test_engine.py: several engines per process).
    engine = VLLMEngine(str(cli_run / "actor"), max_model_len=64)
    try:
        prompt = AutoTokenizer.from_pretrained(cli_run / "actor")("3+4=").input_ids
        request = GenerateRequest([prompt], n=2, temperature=1.0, top_p=1.0, max_tokens=4, seeds=[0])
        generated = engine.generate(request)
    finally:
        engine.close()
    assert len(generated) == 2


PRESETS = sorted(p.stem for p in (ROOT / "conf" / "ppo").glob("*.yaml"))


def test_the_preset_list_is_complete():
    assert {"ppo", "grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "dapo", "gspo", "cispo"} <= set(
        PRESETS
    )


# grpo, gspo and cispo train a rollout step through PPOModule in
# tests/training/test_packing.py::test_packed_and_padded_updates_are_the_same_update[<preset>] (packed = padded
# update), rloo, reinforce_pp, reinforce_pp_baseline and dr_grpo (its seq-mean-token-sum-norm loss over the response
# budget) in tests/training/test_module.py::test_a_preset_trains_a_rollout_step_through_the_module[<preset>];
# their estimators and losses in tests/test_algorithms.py: their
# two-step runs are slow. make test keeps ppo's (the critic) and dapo's (dynamic sampling) through entry.run.
COVERED_PRESETS = {"grpo", "gspo", "cispo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}


@pytest.mark.parametrize(
    "preset", [pytest.param(p, marks=pytest.mark.slow) if p in COVERED_PRESETS else p for p in PRESETS]
)
def test_every_preset_completes_two_rollout_steps(preset, engine, tiny_model_dir, tmp_path):

    # distill needs a teacher: the session's tiny model (the fixture model's shape and tokenizer, other weights)
    teacher = [f"model.teacher.path={tiny_model_dir}"] if preset == "distill" else []
    summary = fixture_run(engine, tmp_path, f"ppo={preset}", *teacher, "trainer.eval_every=0")
    assert summary["rollout_steps"] == 2
    assert summary["optimizer_steps_actor"] == summary["expected_optimizer_steps"] == 4
    assert summary["optimizer_steps_critic"] == (4 if preset == "ppo" else 0)
