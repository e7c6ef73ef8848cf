"""Whole runs on user data through Hydra with the shared vLLM engine: a custom reward by dotted path, GSM8K + math."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tests.helpers import FIXTURE_MODEL, compose_run_config, rollout_step_rows, write_jsonl

SMALL_RUN = [
    "trainer.total_rollout_steps=2",
    "trainer.eval_every=0",
    "model.warm_start.enabled=false",
    "ppo.rollout_batch_size=4",
    "ppo.train_batch_size=16",
    "ppo.micro_train_batch_size=8",
    *FIXTURE_MODEL,
]


def my_reward(prompts, responses, references, extras, *, log_path):
    """A user's reward (named by dotted path in the test): records each call; fails on records marked `fail`."""
    with open(log_path, "a") as f:
        f.write(
            json.dumps({"prompts": prompts, "responses": responses, "references": references, "extras": extras}) + "\n"
        )
    if any(extra["fail"] for extra in extras):
        raise RuntimeError("this record is marked to fail")
    return [len(response) / 8 for response in responses]


def metrics_rows(output_dir: Path) -> list[dict]:
    return rollout_step_rows(output_dir / "metrics.csv")


def test_custom_reward_by_dotted_path_trains_two_rollout_steps(engine, tmp_path):
    from lit_ppo.run import entry

    records = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 3, "fail": a == 4}
        for a, b in [(1, 2), (3, 5), (4, 4), (6, 1)]
    ]
    by_prompt = {r["prompt"]: r for r in records}
    train_file = write_jsonl(records, tmp_path / "train.jsonl")
    calls = tmp_path / "calls.jsonl"
    cfg = compose_run_config(
        "data=file",
        f"data.path={train_file}",
        "data.extra_keys=[level,fail]",
        "data.max_prompt_length=16",
        "reward=custom_example",
        "reward.fn._target_=tests.end_to_end.test_workloads.my_reward",
        f"+reward.fn.log_path={calls}",
        "reward.on_error=zero",
        *SMALL_RUN,
        f"output_dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}",
    )
    summary = entry.run(cfg, tmp_path / "run", engine=engine)
    assert summary["rollout_steps"] == 2

    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    # Per rollout step: the batch of 4 prompts x 4 samples raises (one record fails), then 16 one-sample calls.
    assert [len(call["responses"]) for call in logged] == ([16] + [1] * 16) * 2
    for call in logged:
        assert len(call["prompts"]) == len(call["references"]) == len(call["extras"]) == len(call["responses"])
        assert all(isinstance(r, str) for r in call["responses"])
        for prompt, reference, extras in zip(call["prompts"], call["references"], call["extras"]):
            record = by_prompt[prompt]
            assert reference == record["answer"] and extras == {"level": record["level"], "fail": record["fail"]}
    assert {p for call in logged for p in call["prompts"]} == set(by_prompt)
    # The failing record's 4 samples score 0 and are counted, every rollout step.
    assert [float(row["rollout/reward_errors"]) for row in metrics_rows(tmp_path / "run")] == [4.0, 4.0]


GSM8K_TRAIN = [
    ("Tom has 3 pens and buys 4 more. How many pens?", "He has 3+4=<<3+4=7>>7 pens.\n#### 7"),
    ("A box holds 6 eggs. How many in 2 boxes?", "2*6=<<2*6=12>>12 eggs.\n#### 12"),
    ("Sam had 10 cards and gave away 4. How many left?", "10-4=<<10-4=6>>6 cards.\n#### 6"),
    ("Each bag has 5 apples. How many in 3 bags?", "3*5=<<3*5=15>>15 apples.\n#### 15"),
    ("Ann reads 2 books a week. How many in 4 weeks?", "2*4=<<2*4=8>>8 books.\n#### 8"),
    ("A car costs $1,000 more than $500. Price?", "500+1000=<<500+1000=1500>>1500.\n#### 1,500"),
    ("Half of 9 is what?", "9/2=<<9/2=4.5>>4.5\n#### 4.5"),
    ("Bo has 8 toys and loses 3. How many left?", "8-3=<<8-3=5>>5 toys.\n#### 5"),
]


def test_gsm8k_jsonl_with_the_math_reward(engine, tmp_path, capsys, caplog):
    """`python train.py data=gsm8k reward=math` on a GSM8K-format file, with one bad record skipped."""
    from lit_ppo.run import entry

    rows = [{"question": q, "answer": a} for q, a in GSM8K_TRAIN]
    train_file = write_jsonl(rows + [{"question": "No answer field here?"}], tmp_path / "train.jsonl")
    eval_file = write_jsonl(rows[:2], tmp_path / "test.jsonl")
    cfg = compose_run_config(
        "data=gsm8k",
        f"data.path={train_file}",
        f"data.eval_path={eval_file}",
        "data.system_prompt=null",
        "data.max_prompt_length=100",
        "data.bad_records=skip",
        "reward=math",
        *SMALL_RUN,
        f"output_dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}",
    )
    with caplog.at_level(logging.WARNING, logger="lit_ppo"):
        summary = entry.run(cfg, tmp_path / "run", engine=engine)

    assert summary["rollout_steps"] == 2 and summary["skipped_prompts"] == {"missing_key": 1}
    assert 0.0 <= summary["eval_reward_final"] <= 1.0
    assert f"8 prompts from {train_file} (skipped 1: missing_key=1)" in capsys.readouterr().out  # the printed plan
    assert "skipped 1 train prompts ({'missing_key': 1})" in caplog.text
    rows = metrics_rows(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:  # the math reward's own metrics, and no reward errors
        assert (
            0.0 <= float(row["rollout/reward_correct"]) <= 1.0 and 0.0 <= float(row["rollout/reward_formatted"]) <= 1.0
        )
        assert float(row["rollout/reward_errors"]) == 0.0
