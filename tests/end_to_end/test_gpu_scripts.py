"""The GPU machine's scripts on the CPU (issue 28: a path that only runs on a GPU still gets a CPU-side test that fails
the same way). bench/gpu_e2e.py composes `+experiment=qwen1.5b` with `rollout.engine=hf`, a tokenizer filled to the
model's vocabulary and the recipe's math reward, and runs train.py as a user would; here at its --smoke size, on the
CPU, so a config key, an override or a report column that breaks shows before a GPU lease is spent on it."""

from __future__ import annotations

import csv
import subprocess
import sys

from tests.helpers import ROOT


def test_the_end_to_end_gpu_script_runs_train_py_with_the_hf_engine_and_reports_every_phase(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/gpu_e2e.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "+experiment=qwen1.5b" in out and "rollout.engine=hf" in out
    assert "step | generate_s | reward_s | experience_s | train_s" in out
    assert "median rollout step after the first" in out
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("timing/train_s")]
    assert len(rows) == 2  # the smoke's 2 rollout steps, each with its phases
    assert all(float(r["timing/generate_s"]) > 0 and float(r["perf/trained_tokens"]) > 0 for r in rows)
    assert (tmp_path / "plan.json").exists() and (tmp_path / "run.log").exists()
