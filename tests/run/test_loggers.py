"""`logger=wandb` offline (read back from the run's .wandb file), the mode decision, the secret filter, sample tables."""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_ppo.errors import ConfigError
from lit_ppo.run.loggers import (
    SampleTableLogger,
    drop_secrets,
    make_wandb_logger,
    resolve_wandb_mode,
)
from lit_ppo.topology import RankTopology
from tests.helpers import FIXTURE_MODEL, compose_run_config, fixture_run

SAMPLES = [{"prompt": "3+4=", "response": "7", "reward": 1.0}, {"prompt": "10+5=", "response": "16", "reward": 0.0}]


def parse_wandb_log(data: bytes) -> list:
    """The protobuf records of a .wandb file.

    wandb >= 0.2x has no Python reader (wandb-core writes the file); the format is LevelDB's log:
    a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of chunks, each with a
    7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def read_wandb_records(run_dir: Path, timeout_s: float = 60.0) -> list:
    """The records of an offline run, once they include its exit record: `run.finish()` returns before
    wandb-core has flushed the file."""
    from google.protobuf.message import DecodeError

    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = parse_wandb_log(path.read_bytes())
            if any(r.WhichOneof("record_type") == "exit" for r in records):
                return records
        except DecodeError:  # caught mid-write
            pass
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s:.0f}s"
        time.sleep(0.2)


def history_rows(records) -> list[dict]:
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    """No API key, an empty netrc, and every W&B directory inside tmp_path."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login user password not-wandb\n")
    monkeypatch.setenv("NETRC", str(netrc))
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    return netrc


def test_secret_filter_drops_secret_looking_keys_at_any_depth():
    config = {
        "seed": 0,
        "wandb_api_key": "abc",
        "HF_TOKEN": "x",
        "reward": {"fn": {"_target_": "m.f", "client_secret": "s", "url": "u"}, "db_password": "p"},
        "servers": [{"name": "a", "auth_token": "t"}],
    }
    assert drop_secrets(config) == {
        "seed": 0,
        "reward": {"fn": {"_target_": "m.f", "url": "u"}},
        "servers": [{"name": "a"}],
    }


def test_auto_mode_is_offline_without_credentials_and_online_with_them(no_wandb_credentials, monkeypatch):
    assert resolve_wandb_mode("auto") == "offline"
    assert resolve_wandb_mode("online") == "online"
    no_wandb_credentials.write_text("machine api.wandb.ai login user password 0123abcd\n")
    assert resolve_wandb_mode("auto") == "online"
    no_wandb_credentials.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "0123abcd")
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")  # the user's explicit choice wins over credentials
    assert resolve_wandb_mode("auto") == "offline"
    with pytest.raises(ConfigError, match="fix"):
        resolve_wandb_mode("sometimes")


def test_auto_mode_falls_back_to_offline_when_the_server_cannot_be_reached(tmp_path, no_wandb_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # credentials, but a server nobody can reach with them
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    logger = make_wandb_logger(save_dir=str(tmp_path), mode="auto", init_timeout=1)
    logger.log_metrics({"rollout_step": 1, "rollout/reward_mean": 0.5}, step=1)
    assert logger.experiment.settings.mode == "offline"
    logger.finalize("success")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert [row["rollout/reward_mean"] for row in history_rows(read_wandb_records(run_dir))] == [0.5]


def test_wandb_offline_run_records_metrics_against_rollout_step(engine, tmp_path, no_wandb_credentials):

    out = tmp_path / "run"
    summary = fixture_run(engine, tmp_path, "logger=wandb", "trainer.eval_every=1", out=out)
    assert summary["rollout_steps"] == 2

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    records = read_wandb_records(run_dir)
    rows = [row for row in history_rows(records) if "rollout/reward_mean" in row]
    assert [row["rollout_step"] for row in rows] == [1, 2]
    # The evaluation before any update, at rollout_step 0, as in metrics.csv.
    initial = [r for r in history_rows(records) if r.get("rollout_step") == 0 and "eval/reward" in r]
    assert len(initial) == 1 and initial[0]["eval/reward"] == pytest.approx(summary["eval_reward_initial"])
    assert "eval/pass@4" in initial[0] and "rollout/reward_mean" not in initial[0]
    for key in (
        "rollout/reward_mean",
        "rollout/kl_to_reference",
        "actor/policy_loss",
        "actor/entropy",
        "critic/value_loss",
        "timing/generate_s",
        "timing/train_s",
        "perf/generated_tokens_per_s",
        "eval/reward",
    ):
        assert all(key in row for row in rows), key
    assert rows[-1]["rollout/reward_mean"] == pytest.approx(summary["reward_final"])

    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert [m.step_metric for m in metrics if m.glob_name == "*"][-1] == "rollout_step"

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["seed"] == 0 and config["ppo"]["actor_lr"] == pytest.approx(2e-4)
    assert config["logger"]["name"] == "wandb"
    assert "prompt_key" not in config["data"]  # secret-looking names are dropped, harmless ones with them
    exits = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits and exits[-1].exit_code == 0  # the run was finished when training ended


def test_a_resumed_wandb_run_continues_the_same_run(engine, tmp_path, no_wandb_credentials):
    """logger=wandb offline: the run id is kept in the run directory, and resume=auto writes to that run."""
    from lit_ppo.run import entry

    out = tmp_path / "run"
    common = [
        "logger=wandb",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=1",
        "model.warm_start.enabled=false",
        "data.n_train=64",
        "data.n_eval=8",
        "ppo=grpo",
        f"output_dir={out}",
        f"cache_dir={tmp_path / 'cache'}",
        *FIXTURE_MODEL,
    ]
    entry.run(compose_run_config(*common, "trainer.total_rollout_steps=1"), out, engine=engine)
    run_id = (out / "wandb_run_id").read_text().strip()
    entry.run(compose_run_config(*common, "trainer.total_rollout_steps=2", "resume=auto"), out, engine=engine)
    runs = sorted((out / "wandb").glob("offline-run-*"), key=lambda r: r.stat().st_mtime)
    # both parts write to one run: offline-run-<start time>-<run id>, and "-1" after it where both parts started
    # within the same second (W&B's name for the second directory of a run)
    pattern = rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?"
    assert len(runs) == 2 and all(re.fullmatch(pattern, r.name) for r in runs), [r.name for r in runs]
    records = read_wandb_records(runs[-1])
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run_id
    steps = [row["rollout_step"] for row in history_rows(records) if "rollout/reward_mean" in row]
    assert steps == [2]  # the resumed part logs only what is new
    # A fresh start in the same directory (no resume) is a new W&B run; a directory holding checkpoints refuses a
    # fresh run (one run per directory), so its checkpoints go first, as a user would delete them.
    shutil.rmtree(out / "checkpoints")
    entry.run(compose_run_config(*common, "trainer.total_rollout_steps=1"), out, engine=engine)
    assert (out / "wandb_run_id").read_text().strip() != run_id


def stub_trainer(loggers):
    return SimpleNamespace(loggers=loggers)


def test_sample_table_goes_to_wandb_as_a_table_per_evaluation(tmp_path, no_wandb_credentials):
    logger = make_wandb_logger(save_dir=str(tmp_path), mode="auto")
    callback = SampleTableLogger()
    module = SimpleNamespace(
        eval_history=[{"rollout_step": 0, "eval/reward": 0.5, "samples": SAMPLES}], topology=RankTopology()
    )
    callback.on_train_batch_end(stub_trainer([logger]), module, None, None, 0)
    module.eval_history.append({"rollout_step": 2, "eval/reward": 1.0, "samples": SAMPLES[:1]})
    callback.on_train_end(stub_trainer([logger]), module)
    callback.on_train_end(stub_trainer([logger]), module)  # nothing new: nothing logged
    logger.finalize("success")

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    tables = [row for row in history_rows(read_wandb_records(run_dir)) if "eval/samples/_type" in row]
    assert [(t["rollout_step"], t["eval/samples/_type"], t["eval/samples/nrows"]) for t in tables] == [
        (0, "table-file", 2),
        (2, "table-file", 1),
    ]
    table = json.loads((run_dir / "files" / tables[0]["eval/samples/path"]).read_text())
    assert table["columns"] == ["rollout_step", "prompt", "response", "reward"]
    assert table["data"][0] == [0, "3+4=", "7", 1.0]


def test_sample_table_goes_to_the_console_without_wandb(capsys):
    callback = SampleTableLogger()
    module = SimpleNamespace(
        eval_history=[{"rollout_step": 5, "eval/reward": 0.5, "samples": SAMPLES}], topology=RankTopology()
    )
    callback.on_train_start(stub_trainer([]), module)  # a resumed run: rollout step 5 was shown before
    module.eval_history.append({"rollout_step": 10, "eval/reward": 0.5, "samples": SAMPLES})
    callback.on_train_batch_end(stub_trainer([]), module, None, None, 0)
    callback.on_train_end(stub_trainer([]), module)
    printed = capsys.readouterr().out
    assert printed.count("eval samples at rollout step 10") == 1 and "rollout step 5" not in printed
    assert "10+5=" in printed and "16" in printed and "reward" in printed


def test_the_evaluation_before_any_update_is_shown_before_rollout_step_1(capsys):
    """Its table printed after rollout step 1 (at that step's end), under step 1's progress."""
    callback = SampleTableLogger()
    module = SimpleNamespace(eval_history=[], topology=RankTopology())
    callback.on_train_start(stub_trainer([]), module)  # Lightning: the callbacks' hook, then the module's ...
    module.eval_history.append({"rollout_step": 0, "eval/reward": 0.5, "samples": SAMPLES})  # ... which evaluates
    callback.on_train_batch_start(stub_trainer([]), module, None, 0)  # rollout step 1 starts
    assert capsys.readouterr().out.count("eval samples at rollout step 0") == 1
    callback.on_train_batch_end(stub_trainer([]), module, None, None, 0)
    assert "eval samples" not in capsys.readouterr().out  # shown once


@pytest.mark.slow  # make test: the wandb run's rows from step 0 (the module's logger loop) and the TensorBoard config test
def test_tensorboard_gets_every_evaluation_from_rollout_step_0(engine, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    summary = fixture_run(engine, tmp_path, "logger=tensorboard", "trainer.eval_every=1", out=out)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    evals = events.Scalars("eval/reward")
    assert [e.step for e in evals] == [0, 1, 2]
    assert evals[0].value == pytest.approx(summary["eval_reward_initial"])
    assert evals[-1].value == pytest.approx(summary["eval_reward_final"])
    assert [e.step for e in events.Scalars("rollout/reward_mean")] == [1, 2]


def test_tensorboard_logger_config_writes_events_against_the_rollout_step(tmp_path):
    import hydra
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose_run_config("logger=tensorboard")
    logger = hydra.utils.instantiate(cfg.logger.extra, save_dir=str(tmp_path))
    for step in (1, 2):
        logger.log_metrics({"rollout/reward_mean": 0.25 * step}, step=step)
    logger.finalize("success")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(1, 0.25), (2, 0.5)]
