"""summary.json sums what the rows hold; a row without a timing key is a bug in the logging, not 0 seconds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lit_ppo.run.report import TIMING_KEYS, write_summary
from tests.helpers import plan_of


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
