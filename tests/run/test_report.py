"""summary.json sums what the rows hold; a row without a timing key is a bug in the logging, not 0 seconds; metrics.csv
holds the evaluation before any update as soon as it is done and each rollout step's row once the step ends."""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning as L
import pytest

from lit_ppo.run.report import TIMING_KEYS, write_curves, write_summary
from tests.helpers import build_run, plan_of, read_csv


def run_state(rows: list[dict]) -> SimpleNamespace:
    return SimpleNamespace(
        history=rows,
        eval_history=[],
        rollout_step=len(rows),
        actor_optimizer_steps=2 * len(rows),
        critic_optimizer_steps=2 * len(rows),
        samples_seen=128 * len(rows),
        skipped_updates=0,
    )


def row(**timings: float) -> dict:
    return {"rollout/generated_tokens": 100, "rollout/reward_mean": 0.5, **timings}


PLAN = plan_of(64, steps=2)
TIMINGS = {metric: 1.5 for metric in TIMING_KEYS.values()}


def test_summary_sums_the_timings_of_every_row(tmp_path):
    summary = write_summary(tmp_path, run_state([row(**TIMINGS), row(**TIMINGS)]), PLAN, {})
    assert all(summary[key] == 3.0 for key in TIMING_KEYS)
    assert summary["tokens_generated"] == 200 and json.loads((tmp_path / "summary.json").read_text()) == summary


def test_a_row_without_a_timing_key_fails_instead_of_counting_zero_seconds(tmp_path):
    partial = {k: v for k, v in TIMINGS.items() if k != "timing/weight_sync_s"}
    with pytest.raises(KeyError, match="timing/weight_sync_s"):
        write_summary(tmp_path, run_state([row(**TIMINGS), row(**partial)]), PLAN, {})
    assert not (tmp_path / "summary.json").exists()


def test_curves_of_a_run_without_a_reference_model_show_the_entropy_not_an_empty_kl_panel(tmp_path, monkeypatch):
    """A kl_coef=0 run's curves.png had a KL panel with nothing in it."""
    from matplotlib.figure import Figure

    panels = {}

    def record(figure, path, **kwargs):
        panels.update({ax.get_title(): [list(line.get_ydata()) for line in ax.get_lines()] for ax in figure.axes})

    monkeypatch.setattr(Figure, "savefig", record)
    rows = [
        {"rollout_step": s, "rollout/reward_mean": 0.5, "actor/entropy": 1.0 / s, "rollout/response_length_mean": 4}
        for s in (1, 2)
    ]
    write_curves(tmp_path, rows, [{"rollout_step": 0, "eval/reward": 0.1}, {"rollout_step": 2, "eval/reward": 0.4}])
    assert "KL to reference (per token)" not in panels
    assert panels["policy entropy (per token; no reference model, no KL)"] == [[1.0, 0.5]]
    with_kl = [{**row, "rollout/kl_to_reference": 0.01} for row in rows]
    write_curves(tmp_path, with_kl, [])
    assert panels["KL to reference (per token)"] == [[0.01, 0.01]]


def test_metrics_csv_has_the_evaluation_row_before_step_1_and_each_step_row_once_it_ends(
    tiny_model_dir, engine, arithmetic_files, tmp_path
):
    """The run's `MetricsCSV` callback (the training module writes no file): at the start of each rollout step,
    metrics.csv on disk holds the rollout_step 0 row (the evaluation before any update) and every finished step's."""
    on_disk = []

    class AtStepStart(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            on_disk.append([row["rollout_step"] for row in read_csv(tmp_path / "metrics.csv")])

    trainer, module, datamodule, _ = build_run(
        tiny_model_dir, engine, arithmetic_files, tmp_path, total_rollout_steps=2, callbacks=[AtStepStart()]
    )
    trainer.fit(module, datamodule=datamodule)
    rows = read_csv(tmp_path / "metrics.csv")
    assert on_disk[:2] == [["0"], ["0", "1"]]  # (with a dataloader_iter, Lightning starts a third to find no batch)
    assert [row["rollout_step"] for row in rows] == ["0", "1", "2"]
    assert rows[0]["eval/reward"] != "" and rows[0]["optimizer_step"] == "0"
    assert int(rows[2]["optimizer_step"]) == module.actor_optimizer_steps
    # Issue 51's numerics in every step's row: 4 mini-batches (old log-probs from the experience forward); the prompts
    # are short, so every token is in the first depth bin, whose mean is then the batch's logprob_abs_diff.
    for row in rows[1:]:
        assert float(row["actor/ratio_first_minibatch_max_dev"]) == 0.0
        assert 0 <= float(row["actor/experience_ratio_first_minibatch_max_dev"]) < 1e-5  # float32
        depth = float(row["rollout/logprob_abs_diff_depth_0-512"])
        assert depth == pytest.approx(float(row["rollout/logprob_abs_diff"]), rel=1e-9) and depth < 1e-4
        assert float(row["rollout/ratio_outside_band_fraction"]) == 0.0
    assert not any("depth_512" in key for key in rows[1])  # bins without tokens are left out
