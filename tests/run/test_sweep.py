"""`python train.py -m ...`: every job in its own directory, one engine after another, and the sweep summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from lit_ppo.run.sweep import path_list, shared_job_directory, write_sweep_summary
from tests.helpers import FIXTURE_MODEL, ROOT, read_csv


def test_multirun_of_two_jobs_writes_two_runs_and_the_sweep_summary(tmp_path):
    sweep = tmp_path / "sweep"
    # Small and fast: each job still builds its model, starts its own vLLM engine and trains one rollout step.
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "seed=0,1",
        "trainer.total_rollout_steps=1",
        "model.warm_start.enabled=false",
        "data.n_train=16",
        "data.n_eval=4",
        "trainer.eval_every=0",
        "ppo.rollout_batch_size=8",
        "ppo.train_batch_size=32",
        "ppo.micro_train_batch_size=32",
        "rollout.eval_samples_per_prompt=1",
        *FIXTURE_MODEL,
        f"hydra.sweep.dir={sweep}",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    for job, seed in (("0", 0), ("1", 1)):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["rollout_steps"] == 1 and summary["optimizer_steps_actor"] == 1
        assert (sweep / job / "metrics.csv").exists()
        assert f"seed={seed}" in yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())

    rows = read_csv(sweep / "sweep_summary.csv")
    assert [(r["job"], r["seed"], r["status"], r["rollout_steps"]) for r in rows] == [
        ("0", "0", "done", "1"),
        ("1", "1", "done", "1"),
    ]
    for column in ("eval_reward_initial", "eval_reward_final", "reward_final", "optimizer_steps_actor", "wall_seconds"):
        assert all(r[column] != "" for r in rows), column
    markdown = (sweep / "sweep_summary.md").read_text()
    assert "`seed=0`" in markdown and "`seed=1`" in markdown and markdown.count("| done |") == 2


def test_sweep_summary_orders_jobs_numerically_and_lists_jobs_without_results(tmp_path):
    for job, overrides, summary in (
        ("10", ["ppo=grpo", "seed=1"], {"rollout_steps": 3, "eval_reward_final": 0.25}),
        ("2", ["ppo=ppo", "seed=0"], {"rollout_steps": 3, "eval_reward_final": 0.5}),
        ("3", ["+extra=1"], None),
    ):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        if summary:
            (tmp_path / job / "summary.json").write_text(json.dumps(summary))
    write_sweep_summary(tmp_path)
    rows = read_csv(tmp_path / "sweep_summary.csv")
    assert [(r["job"], r["ppo"], r["seed"], r["extra"], r["status"], r["eval_reward_final"]) for r in rows] == [
        ("2", "ppo", "0", "", "done", "0.5"),
        ("3", "", "", "1", "no summary.json", ""),
        ("10", "grpo", "1", "", "done", "0.25"),
    ]
    assert "| 2 | `ppo=ppo` `seed=0` | done |  | 0.500 |" in (tmp_path / "sweep_summary.md").read_text()


def test_a_sweep_is_refused_where_every_job_would_write_into_one_directory():
    def problem(*overrides: str, output_dir=None, subdir="${hydra.job.num}", params=None, **keys):
        hydra = {"overrides": {"task": list(overrides)}, "sweep": {"subdir": subdir}, "sweeper": {"params": params}}
        return shared_job_directory(OmegaConf.create({"output_dir": output_dir, "seed": 0, "hydra": hydra, **keys}))

    shared = problem("seed=0,1", output_dir="/tmp/shared")
    assert shared.startswith("output_dir=/tmp/shared would be shared by every job of this sweep") and "\n" not in shared
    assert "leave output_dir unset" in shared and "output_dir='/tmp/shared/${hydra:job.num}'" in shared, shared
    assert problem("seed=0,1", output_dir="${oc.env:HOME}/runs")  # an interpolation, the same for every job
    assert problem("seed=0,1", output_dir="runs/${ppo.name}")  # a key no job changes
    assert problem(output_dir="runs/x", params={"seed": "0,1"})  # swept in the config (hydra.sweeper.params)
    assert problem("seed=0,1", subdir="same").startswith("hydra.sweep.subdir=same would be shared")
    # each job its own directory
    assert problem("seed=0,1") is None  # multirun/<date>/<time>/<job number>
    assert problem("seed=0,1", output_dir="runs/x_${hydra:job.num}") is None
    assert problem("seed=0,1", output_dir="runs/x/${hydra.job.override_dirname}") is None
    assert problem("seed=range(0,3)", output_dir="runs/x_${seed}") is None
    assert problem("ppo=grpo,rloo", "seed=0", output_dir="runs/${ppo.name}") is None  # a swept group's key
    assert problem("output_dir=runs/a,runs/b", "seed=0") is None
    assert problem("seed=0", output_dir="runs/x") is None  # one job
    assert problem("ppo=grpo,rloo", output_dir="runs/${hydra:runtime.choices.ppo}") is None  # a swept group's choice
    assert problem("seed=0,1", output_dir="runs/${name}", name="${ppo.name}_${seed}") is None  # through another key
    assert problem("seed=0,1", output_dir="runs/${name}", name="${ppo.name}")  # ... that no job changes


def sweep_plans(tmp_path, output_dir: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "train.py", "-m", "seed=0,1", "mode=plan", f"output_dir={output_dir}"]
    command.append(f"hydra.sweep.dir={tmp_path / 'sweep'}")
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_train_py_refuses_a_sweep_into_one_output_dir_before_its_first_job(tmp_path):
    """It was a warning of Hydra's (an exception in a callback), and every job ran into the one directory: with
    resume=auto the second "resumed" the first's finished run, trained nothing, and the sweep exited 0."""
    refused = sweep_plans(tmp_path, str(tmp_path / "shared"))
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: output_dir={tmp_path / 'shared'} would be shared"), lines
    assert not list(tmp_path.iterdir())  # before the first job: nothing written


@pytest.mark.slow
def test_train_py_runs_a_sweep_whose_output_dir_names_a_swept_key(tmp_path):
    planned = sweep_plans(tmp_path, str(tmp_path / "runs" / "seed${seed}"))
    assert planned.returncode == 0, planned.stderr[-3000:]
    plans = [json.loads((tmp_path / "runs" / f"seed{seed}" / "plan.json").read_text()) for seed in (0, 1)]
    assert plans[0] == plans[1]  # the same plan, written twice, in two directories


def test_sweep_summary_of_mode_eval_jobs_reads_their_eval_json(tmp_path):
    """A sweep of evaluations (`-m mode=eval model.path=a,b`) writes eval.json, no summary.json."""
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["mode=eval", "model.path=a"]))
    (tmp_path / "0" / "eval.json").write_text(json.dumps({"metrics": {"eval/reward": 0.75}, "wall_seconds": 3.0}))
    write_sweep_summary(tmp_path)
    [row] = read_csv(tmp_path / "sweep_summary.csv")
    assert (row["model.path"], row["status"], row["eval_reward_final"], row["wall_seconds"]) == (
        "a",
        "evaluated",
        "0.75",
        "3.0",
    )


def test_the_analysis_notebooks_run_dirs_from_papermill_are_a_list_of_paths():
    """`papermill -p run_dirs '[a, b]'` passes a string, which the notebook iterated over character by character."""
    assert path_list("[runs/a, multirun/2026-01-01/10-00-00]") == ["runs/a", "multirun/2026-01-01/10-00-00"]
    assert path_list('["runs/a", "runs/b"]') == ["runs/a", "runs/b"]
    assert path_list("runs/a") == ["runs/a"] and path_list(["runs/a", "runs/b"]) == ["runs/a", "runs/b"]
