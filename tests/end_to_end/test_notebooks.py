"""The notebooks run top to bottom in a fresh kernel of this environment's Python."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tests.helpers import ROOT, fixture_run

REPO = ROOT


def python3_kernel_of_this_python(tmp_path: Path, monkeypatch) -> None:
    """Point the kernel name "python3" at sys.executable (JUPYTER_PATH is searched first)."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (lit-ppo tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))


# Appended to analyze_run.ipynb by its test: what the two figures hold, as one JSON line.
FIGURE_CONTENTS = """
import json
def _contents(figure):
    return {
        "panels": {ax.get_title(): [(l.get_label(), l.get_color()) for l in ax.get_lines()] for ax in figure.axes},
        "axes_legends": sum(ax.get_legend() is not None for ax in figure.axes),
        "figure_legends": [[t.get_text() for t in legend.get_texts()] for legend in figure.legends],
    }
print("FIGURES " + json.dumps({"curves": _contents(curves_figure), "timings": _contents(timings_figure)}))
"""


def run_notebook(path: Path, workdir: Path, parameters: dict, after: str | None = None) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "the notebook needs exactly one cell tagged 'parameters'"
    tagged[0].source += "\n" + "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    if after:
        nb.cells.append(nbformat.v4.new_code_cell(after))
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(workdir)}}).execute()
    return nb


def test_step_accounting_notebook(tmp_path, monkeypatch):
    python3_kernel_of_this_python(tmp_path, monkeypatch)
    workdir = tmp_path / "work"
    workdir.mkdir()
    figure = workdir / "figure.png"
    nb = run_notebook(
        REPO / "notebooks" / "step_accounting.ipynb",
        workdir,
        {"figure_path": str(figure), "repo_root": str(REPO)},
    )
    assert figure.exists() and figure.stat().st_size > 1000
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "optimizer steps per rollout step" in printed


def test_analyze_run_notebook_plots_a_run_and_a_sweep(engine, tmp_path, monkeypatch):
    import shutil

    import yaml

    run = tmp_path / "run"
    fixture_run(engine, tmp_path, "trainer.eval_every=1", out=run)
    sweep = tmp_path / "sweep"  # laid out as `train.py -m ppo=ppo seed=0,1` would, from the one run's files
    for job in ("0", "1"):
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["ppo=ppo", f"seed={job}"]))
        for name in ("metrics.csv", "summary.json"):
            shutil.copy(run / name, sweep / job / name)
    # A mixed set: the first job logged no KL (as a run without a reference model), and no reward timing.
    import pandas as pd

    first = pd.read_csv(sweep / "0" / "metrics.csv")
    assert "rollout/kl_to_reference" in first and "timing/reward_s" in first
    first.drop(columns=["rollout/kl_to_reference", "timing/reward_s"]).to_csv(sweep / "0" / "metrics.csv", index=False)

    python3_kernel_of_this_python(tmp_path, monkeypatch)
    workdir = tmp_path / "work"
    workdir.mkdir()
    figures = tmp_path / "figures"
    nb = run_notebook(
        REPO / "notebooks" / "analyze_run.ipynb",
        workdir,
        # as `papermill -p run_dirs '[a, b]'` passes it: a string (it was iterated over character by character)
        {"run_dirs": f"[{sweep}, {run}]", "figure_dir": str(figures), "repo_root": str(REPO)},
        after=FIGURE_CONTENTS,
    )
    for name in ("curves.png", "timings.png"):
        assert (figures / name).stat().st_size > 10_000, name
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert (
        "3 run(s)" in printed and "ppo=ppo seed=0:" in printed and "ppo=ppo seed=1:" in printed and "  run:" in printed
    )
    figures_json = json.loads(next(line for line in printed.splitlines() if line.startswith("FIGURES "))[8:])
    labels = ["ppo=ppo seed=0", "ppo=ppo seed=1", "run"]
    curves = figures_json["curves"]
    # One legend per figure, naming every run, and none on a panel.
    assert curves["figure_legends"] == [labels] and curves["axes_legends"] == 0
    assert figures_json["timings"]["axes_legends"] == 0 and len(figures_json["timings"]["figure_legends"]) == 1
    assert "reward" in figures_json["timings"]["figure_legends"][0]  # a phase one run did not time is still shown
    colors = {}
    for title, lines in curves["panels"].items():
        for label, color in lines:
            assert label in labels, (title, label)  # every curve is labelled by its run
            assert colors.setdefault(label, color) == color, (title, label)  # a run keeps its colour in every panel
    assert len(set(colors.values())) == 3
    assert [label for label, _ in curves["panels"]["KL to reference (per token)"]] == labels[1:]  # seed=0 had none
    assert [label for label, _ in curves["panels"]["training reward (mean)"]] == labels
