"""The default experiment learns (slow: `make test-slow`; `make train` shows the same run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ppo", "grpo"])
def test_default_experiment_learns(preset, tmp_path):
    # The default recipe, seeds fixed; the warm start is cached in the project's .cache like `make train`.
    result = subprocess.run([sys.executable, "train.py", f"ppo={preset}", f"output_dir={tmp_path}",
                             f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_reward_final"] - summary["eval_reward_initial"] >= 0.4, summary
    assert summary["optimizer_steps_actor"] == summary["expected_optimizer_steps"]
