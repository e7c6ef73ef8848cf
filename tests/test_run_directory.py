"""One run per directory: a fresh run refuses a directory holding checkpoints, a resumed run refuses another config
(but for the run length) or another algorithm, rotation keeps the running run's newest checkpoint, and
`output_dir=` leaves no Hydra directory in the working directory."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_ppo.checkpoints import (
    RolloutCheckpoint,
    check_run_directory,
    checkpoint_path,
    config_differences,
    list_checkpoints,
    prune,
)
from lit_ppo.errors import ConfigError
from tests.helpers import ROOT, build_run, compose_run_config


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_a_second_run_in_a_used_directory_is_refused_and_resume_auto_refuses_another_lr(tmp_path):
    """The issue's scenario: a run with checkpoints, then another run with another learning rate in the same
    directory (which used to delete its own checkpoint and leave resume=auto to continue the first run)."""
    out = tmp_path / "run"
    common = [
        "trainer.checkpoint_every=1",  # with keep_checkpoints=2: rollout steps 2 and 3 stay
        "trainer.eval_every=0",
        "model.warm_start.steps=20",
        "data.n_train=64",
        "data.n_eval=8",
        f"output_dir={out}",
    ]

    def train(*overrides: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "train.py", *common, *overrides]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)

    first = train("trainer.total_rollout_steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    before = list_checkpoints(out / "checkpoints")
    assert [p.name for p in before] == ["rollout_step=000002.ckpt", "rollout_step=000003.ckpt"]
    config = (out / "config.yaml").read_text()

    second = train("trainer.total_rollout_steps=2", "ppo.actor_lr=1e-3")
    assert second.returncode == 2
    line = error_line(second)
    assert f"output_dir={out}" in line and "resume=auto" in line and "another output_dir" in line, line
    assert list_checkpoints(out / "checkpoints") == before and (out / "config.yaml").read_text() == config

    resumed = train("trainer.total_rollout_steps=5", "ppo.actor_lr=1e-3", "resume=auto")
    assert resumed.returncode == 2
    line = error_line(resumed)
    assert "ppo.actor_lr: 0.0002 -> 0.001" in line and "another output_dir" in line, line
    assert list_checkpoints(out / "checkpoints") == before


def test_only_the_run_length_and_what_is_recorded_may_change_on_resume(tmp_path):
    def settings(*overrides: str) -> dict:
        return compose_run_config(*overrides).to_dict()

    saved = settings("trainer.total_rollout_steps=6")
    assert config_differences(saved, settings("trainer.total_rollout_steps=9", "trainer.checkpoint_every=1")) == []
    assert config_differences(saved, settings("trainer.total_rollout_steps=null", "trainer.data_epochs=2")) == []
    assert config_differences(saved, settings("seed=1")) == ["seed: 0 -> 1"]
    changed = config_differences(saved, settings("ppo=grpo"))
    assert any(line.startswith("ppo.advantage_estimator: gae -> grpo") for line in changed), changed


def test_the_number_of_ranks_and_the_waits_limits_may_change_on_resume():
    """A requeued job on another node count (resharding: the checkpoint's states are whole), or with a longer limit
    on a wait, continues the run; the strategy itself may not change (its checkpoint's layout is its own)."""

    def settings(*overrides: str) -> dict:
        return compose_run_config(*overrides).to_dict()

    saved = settings("strategy=fsdp", "strategy.devices=8", "strategy.num_nodes=2")
    assert config_differences(saved, settings("strategy=fsdp", "strategy.devices=4", "strategy.num_nodes=1")) == []
    assert (
        config_differences(
            saved,
            settings(
                "strategy=fsdp",
                "strategy.devices=8",
                "strategy.num_nodes=2",
                "trainer.collective_timeout_s=60",
                "rollout.engine_start_timeout_s=60",
            ),
        )
        == []
    )
    assert "strategy.name: fsdp -> ddp" in config_differences(saved, settings("strategy=ddp", "strategy.devices=8"))


def write_checkpoints(directory: Path, steps: list[int]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for step in steps:
        checkpoint_path(directory, step).write_bytes(b"not read here")


def test_an_explicit_resume_older_than_the_directorys_latest_is_refused(tmp_path):
    config = compose_run_config()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    write_checkpoints(tmp_path / "checkpoints", [4, 6])
    older = checkpoint_path(tmp_path / "checkpoints", 4)
    with pytest.raises(ConfigError, match="older than rollout_step=000006.ckpt"):
        check_run_directory(dataclasses.replace(config, resume=str(older)), tmp_path)
    check_run_directory(dataclasses.replace(config, resume="auto"), tmp_path)  # the latest, same config: fine
    (tmp_path / "checkpoints" / "rollout_step=000008.ckpt.tmp").write_bytes(b"half written")
    assert list_checkpoints(tmp_path / "checkpoints")[-1].name == "rollout_step=000006.ckpt"


def test_another_strategy_on_resume_is_refused_naming_the_settings_to_resume_with(tmp_path):
    """A 2-process DDP run resumed on one process with the default strategy=single: the line names the user's keys
    (the strategy, and the devices this run has) rather than the strategy.lightning.* values its group sets."""
    saved = compose_run_config("strategy=ddp", "strategy.devices=2")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved.to_dict()))
    write_checkpoints(tmp_path / "checkpoints", [1])

    def refusal(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            check_run_directory(dataclasses.replace(compose_run_config(*overrides), resume="auto"), tmp_path)
        assert "\n" not in str(info.value) and "strategy.lightning" not in str(info.value)
        return str(info.value)

    assert refusal() == (
        "resume=auto: rollout_step=000001.ckpt was written under strategy=ddp, this run is strategy=single; the "
        "strategy may not change on resume (the number of ranks may); fix: resume with strategy=ddp "
        "strategy.devices=1, or start a new run in another output_dir"
    )
    line = refusal("strategy=fsdp", "strategy.devices=4", "strategy.num_nodes=2", "seed=3")
    assert (
        "this run is strategy=fsdp; the strategy may not change on resume (the number of ranks may), nor seed: 0 -> 3"
        in line
    )
    assert (
        f"fix: resume with strategy=ddp strategy.devices=4 strategy.num_nodes=2 and the values in {tmp_path / 'config.yaml'}"
        in line
    )
    check_run_directory(  # the strategy it was written with, on one rank: fine
        dataclasses.replace(compose_run_config("strategy=ddp", "strategy.devices=1"), resume="auto"), tmp_path
    )


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    # Higher-numbered checkpoints of another timeline must not push out the running run's newest one.
    write_checkpoints(tmp_path, [4, 6, 5])
    prune(tmp_path, keep=1, newest=checkpoint_path(tmp_path, 5))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["rollout_step=000005.ckpt"]
    write_checkpoints(tmp_path, [4, 6, 7])
    prune(tmp_path, keep=2, newest=checkpoint_path(tmp_path, 7))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["rollout_step=000006.ckpt", "rollout_step=000007.ckpt"]


def test_resuming_a_ppo_checkpoint_as_grpo_is_refused_in_one_line(tiny_model_dir, engine, arithmetic_files, tmp_path):
    checkpoints = RolloutCheckpoint(tmp_path / "ppo" / "checkpoints", every=1, keep=1)
    trainer, module, datamodule, _ = build_run(
        tiny_model_dir, engine, arithmetic_files, tmp_path / "ppo", callbacks=[checkpoints]
    )
    trainer.fit(module, datamodule=datamodule)
    saved = list_checkpoints(tmp_path / "ppo" / "checkpoints")[-1]
    trainer, module, datamodule, _ = build_run(
        tiny_model_dir,
        engine,
        arithmetic_files,
        tmp_path / "grpo",
        total_rollout_steps=2,
        advantage_estimator="grpo",
        kl_coef=0.0,
    )
    assert module.critic is None
    with pytest.raises(ConfigError, match=r"holds the models \[.*'critic'.*\] but this run builds \['actor'\]"):
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(saved), weights_only=False)


def test_output_dir_leaves_no_hydra_directory_in_the_working_directory(tmp_path):
    work, out = tmp_path / "work", tmp_path / "run"
    work.mkdir()
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "mode=plan", f"output_dir={out}"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(work.iterdir()) == []  # no outputs/<date>/<time>/.hydra
    assert (out / "plan.json").is_file() and (out / ".hydra" / "config.yaml").is_file()
