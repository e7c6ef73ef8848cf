"""One run per directory: a fresh run refuses a directory holding checkpoints, a resumed run refuses another config
(but for the run length) or another algorithm, rotation keeps the running run's newest checkpoint, and
`output_dir=` leaves no Hydra directory in the working directory."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from lit_ppo.atomic import directory_problem
from lit_ppo.checkpoints import RolloutCheckpoint, checkpoint_path, list_checkpoints, prune, save_atomic
from lit_ppo.errors import ConfigError, DirectoryError
from lit_ppo.resume import (
    REMEDY_KEYS,
    check_run_directory,
    checkpoint_problem,
    config_differences,
    finished_note,
    fresh_start_note,
)
from lit_ppo.run.prepare import preflight
from tests.helpers import ROOT, build_run, compose_run_config
from tests.helpers.resume import write_checkpoint


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_a_second_run_in_a_used_directory_is_refused_and_resume_auto_refuses_another_seed(tmp_path):
    """The issue's scenario: a run with checkpoints, then another run with another learning rate in the same
    directory (which used to delete its own checkpoint and leave resume=auto to continue the first run); resumed with
    another seed, refused (a learning rate may change on resume: the fix NonFiniteUpdatesError names). The first run's
    directory as it leaves it (its config.yaml, its last two checkpoints), written here: no model is trained or loaded."""
    out = tmp_path / "run"
    common = ["model.warm_start.steps=20", "data.n_train=64", "data.n_eval=8"]
    out.mkdir()
    config = preflight(compose_run_config(*common, "trainer.total_rollout_steps=3")).config  # as the run wrote it
    (out / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    write_checkpoints(out / "checkpoints", [2, 3])
    before = list_checkpoints(out / "checkpoints")

    second = subprocess.run(  # the process: exit 2, one line, nothing written into the directory
        [
            sys.executable,
            "train.py",
            *common,
            "trainer.total_rollout_steps=2",
            "ppo.actor_lr=1e-3",
            f"output_dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 2
    line = error_line(second)
    assert f"output_dir={out}" in line and "resume=auto" in line and "another output_dir" in line, line
    assert list_checkpoints(out / "checkpoints") == before
    assert (out / "config.yaml").read_text() == yaml.safe_dump(config.to_dict())

    resumed = compose_run_config(*common, "trainer.total_rollout_steps=5", "seed=1", "resume=auto")
    with pytest.raises(ConfigError, match="seed: 0 -> 1") as refused:
        check_run_directory(resumed, out)
    assert "another output_dir" in str(refused.value) and "\n" not in str(refused.value)
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


def test_the_number_of_ranks_and_the_context_parallel_size_may_change_on_resume():
    """Issue 51: a checkpoint of C = 2 on 2 ranks resumes at C = 1 on 1 or 2 ranks, and one of C = 1 at C = 2 (the
    states are whole, the data position global: tests/end_to_end/test_context_parallel_cli.py trains it)."""

    def settings(*overrides: str) -> dict:
        return compose_run_config("strategy=ddp", "strategy.accelerator=cpu", *overrides).to_dict()

    saved = settings("strategy.devices=2", "strategy.context_parallel_size=2")
    assert config_differences(saved, settings("strategy.devices=1")) == []
    assert config_differences(saved, settings("strategy.devices=2")) == []
    assert config_differences(settings("strategy.devices=2"), saved) == []


def test_the_fixes_the_errors_name_may_change_on_resume_with_one_line_each(tmp_path, capsys):
    """Issue 36 item 5: a run stopped by NonFiniteUpdatesError, DynamicSamplingShortfallError or RolloutMismatchError
    is resumed with the fix its error names; each changed setting is one line with its old and new values."""
    saved = compose_run_config("ppo=dapo")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved.to_dict()))
    write_checkpoints(tmp_path / "checkpoints", [3])
    fixed = compose_run_config(
        "ppo=dapo",
        "ppo.actor_lr=1e-5",
        "ppo.critic_lr=2e-5",
        "ppo.dynamic_sampling.max_generation_rounds=9",
        "ppo.dynamic_sampling.on_shortfall=stop",
        "rollout.max_logprob_abs_diff=null",
        "rollout.episodes.check_token_ids=false",
        "resume=auto",
    )
    capsys.readouterr()
    check_run_directory(fixed, tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(REMEDY_KEYS) == 6, lines
    changes = [
        ("0.0002", "1e-05"),
        ("0.0005", "2e-05"),
        ("3", "9"),
        ("fill", "stop"),
        ("0.5", "None"),
        ("True", "False"),
    ]
    for key, line, (before, after) in zip(REMEDY_KEYS, lines, changes):
        assert line.startswith(f"resume: {key} changed from {before} to {after} "), line
    # Anything else is still refused, naming what may change.
    with pytest.raises(
        ConfigError,
        match=r"ppo.clip_ratio_low: .*the fixes errors name \(ppo.actor_lr, .*rollout.episodes.check_token_ids\)",
    ):
        check_run_directory(
            dataclasses.replace(fixed, ppo=dataclasses.replace(fixed.ppo, clip_ratio_low=0.3)), tmp_path
        )


def test_every_error_that_says_then_resume_auto_names_only_settings_a_resume_may_change():
    """Each message in the package that ends its fix with "then resume=auto" (grep: every string constant of the
    package, f-strings joined) names, between its "fix:" and that phrase, only keys that check_run_directory lets
    change (CHANGEABLE_KEYS): the fix the error advises is not then refused by the resume it advises."""
    import ast
    import re

    from lit_ppo.resume import CHANGEABLE_KEYS

    sections = {"ppo", "rollout", "trainer", "model", "reward", "strategy", "data", "eval"}
    advised: dict[str, list[str]] = {}
    for path in sorted((ROOT / "lit_ppo").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Call, ast.JoinedStr)):
                continue
            parts = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            text = "".join(parts)
            for fix in re.findall(r"fix: (.*?)then resume=auto", text):
                keys = [k for k in re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)", fix) if k.split(".")[0] in sections]
                advised.setdefault(f"{path.relative_to(ROOT)}: {fix}", keys)
    named = {k for keys in advised.values() for k in keys}
    # The three errors that stop a run with a checkpoint name their fixes, found by the walk.
    assert {"ppo.actor_lr", "ppo.critic_lr", "rollout.max_logprob_abs_diff"} <= named, advised
    assert {"ppo.dynamic_sampling.max_generation_rounds", "ppo.dynamic_sampling.on_shortfall"} <= named, advised
    refused = {
        where: [k for k in keys if not any(k == c or k.startswith(c + ".") for c in CHANGEABLE_KEYS)]
        for where, keys in advised.items()
    }
    assert not any(refused.values()), {w: k for w, k in refused.items() if k}


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
    """Checkpoints that pass the check before a resume (`checkpoint_problem`) and hold no model."""
    for step in steps:
        write_checkpoint(checkpoint_path(directory, step))


def test_an_explicit_resume_older_than_the_directorys_latest_is_refused(tmp_path):
    config = compose_run_config()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    write_checkpoints(tmp_path / "checkpoints", [4, 6])
    older = checkpoint_path(tmp_path / "checkpoints", 4)
    with pytest.raises(ConfigError, match="older than rollout_step_000006.ckpt"):
        check_run_directory(dataclasses.replace(config, resume=str(older)), tmp_path)
    check_run_directory(dataclasses.replace(config, resume="auto"), tmp_path)  # the latest, same config: fine
    (tmp_path / "checkpoints" / "rollout_step_000008.ckpt.tmp").write_bytes(b"half written")
    assert list_checkpoints(tmp_path / "checkpoints")[-1].name == "rollout_step_000006.ckpt"


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
        "resume=auto: rollout_step_000001.ckpt was written under strategy=ddp, this run is strategy=single; the "
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
    assert [p.name for p in list_checkpoints(tmp_path)] == ["rollout_step_000005.ckpt"]
    write_checkpoints(tmp_path, [4, 6, 7])
    prune(tmp_path, keep=2, newest=checkpoint_path(tmp_path, 7))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["rollout_step_000006.ckpt", "rollout_step_000007.ckpt"]


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


# ------------------------------------------------------------------ resume that says what it found (issue 40, item 3)


def one_line_refusal(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return error_line(result)


def test_resume_auto_without_output_dir_is_refused_before_any_model_loads(tmp_path):
    """It started from scratch in a new outputs/<date>/<time>/ on every start (every requeue), exit 0."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "resume=auto"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = one_line_refusal(result)
    assert line.startswith("error: resume=auto without output_dir: this run writes into a new directory named after")
    assert "fix: give the run a fixed directory" in line and "output_dir=runs/<name> resume=auto" in line
    assert not list(tmp_path.rglob("checkpoints")) and not list(tmp_path.rglob("plan.json"))
    # A fixed Hydra run directory can hold a checkpoint: not refused (planned here, nothing loaded).
    fixed = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "mode=plan", "resume=auto", f"hydra.run.dir={tmp_path / 'fixed'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fixed.returncode == 0, fixed.stderr[-3000:]


def test_resume_auto_in_a_directory_without_a_checkpoint_says_so(tmp_path):
    """A misspelt or empty output_dir started fresh without a word."""
    assert fresh_start_note(None, tmp_path) is None and fresh_start_note("auto", tmp_path) == (
        f"resume=auto: no checkpoint in {tmp_path / 'checkpoints'}; output_dir={tmp_path} holds no earlier run (is it "
        "the directory of the run to continue?); starting at rollout step 0"
    )
    (tmp_path / "config.yaml").write_text("{}")  # a run that stopped before its first checkpoint
    assert "holds a run that stopped before its first checkpoint; starting at rollout step 0" in fresh_start_note(
        "auto", tmp_path
    )
    write_checkpoints(tmp_path / "checkpoints", [2])
    assert fresh_start_note("auto", tmp_path) is None


def test_a_finished_run_resumed_exits_0_in_one_line_without_loading_anything(tmp_path):
    """resume=auto on a run already at its length started the engine, loaded the checkpoint, evaluated again and
    exited 0 without a word. Here the checkpoints hold no model: nothing may load one from them."""
    out = tmp_path / "run"
    overrides = ["trainer.total_rollout_steps=2", "model.warm_start.steps=20", "data.n_train=64", "data.n_eval=8"]
    out.mkdir()
    config = preflight(compose_run_config(*overrides)).config  # as the run wrote it: ppo.packing resolved
    (out / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    write_checkpoints(out / "checkpoints", [1, 2])
    (out / "summary.json").write_text(json.dumps({"rollout_steps": 2}))
    result = subprocess.run(
        [sys.executable, "train.py", *overrides, f"output_dir={out}", "resume=auto"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("resume=")]
    assert lines == [
        "resume=auto: rollout_step_000002.ckpt is at the end of the run (rollout step 2 of 2), and its run finished "
        "there (summary.json); nothing to train, exiting; to train longer, raise trainer.total_rollout_steps (or "
        "trainer.data_epochs)"
    ], result.stdout[-3000:]
    assert not (out / "plan.json").exists() and json.loads((out / "summary.json").read_text()) == {"rollout_steps": 2}


@pytest.mark.slow
def test_resume_auto_says_it_starts_fresh_and_a_finished_run_exits_without_training(tmp_path):
    """An output_dir with no checkpoint started fresh without a word; a run already at its length was resumed (its
    engine started, its weights loaded), re-evaluated, and exited 0 without saying so."""
    out = tmp_path / "run"
    command = [
        sys.executable,
        "train.py",
        "trainer.total_rollout_steps=1",
        "trainer.eval_every=0",
        "model.warm_start.steps=20",
        "data.n_train=64",
        "data.n_eval=8",
        f"output_dir={out}",
        "resume=auto",
    ]
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    notes = [line for line in first.stdout.splitlines() if line.startswith("resume=auto")]
    assert notes == [
        f"resume=auto: no checkpoint in {out / 'checkpoints'}; output_dir={out} holds no earlier run (is it the "
        "directory of the run to continue?); starting at rollout step 0"
    ], first.stdout[-3000:]
    assert "critic: the policy's weights with a new value head, starting at zero" in first.stdout
    files = {name: (out / name).read_bytes() for name in ("summary.json", "metrics.csv", "plan.json")}

    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    notes = [line for line in again.stdout.splitlines() if line.startswith("resume=")]
    assert notes == [
        "resume=auto: rollout_step_000001.ckpt is at the end of the run (rollout step 1 of 1), and its run finished "
        "there (summary.json); nothing to train, exiting; to train longer, raise trainer.total_rollout_steps (or "
        "trainer.data_epochs)"
    ], again.stdout[-3000:]
    assert "eval samples" not in again.stdout and "run finished:" not in again.stdout  # no evaluation, no new files
    assert {name: (out / name).read_bytes() for name in files} == files
    assert "vLLM" not in (out / "logs" / "run.log").read_text().split(notes[0])[-1]  # no engine after the line

    # Longer now: it resumes, and its critic is the checkpoint's (every resume said "a new value head, starting at
    # zero").
    longer = subprocess.run(
        [*command, "trainer.total_rollout_steps=2"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / 'rollout_step_000001.ckpt'}" in longer.stdout
    assert "value head" not in longer.stdout and "resume=auto" not in longer.stdout


def test_a_checkpoint_past_the_run_length_is_finished_only_where_its_run_wrote_its_final_files(tmp_path):
    checkpoint = checkpoint_path(tmp_path / "checkpoints", 8)
    assert finished_note("auto", checkpoint, 6, tmp_path) is None  # killed after it, before summary.json: resumed
    (tmp_path / "summary.json").write_text(json.dumps({"rollout_steps": 6}))
    assert finished_note("auto", checkpoint, 6, tmp_path) is None  # summary.json of an earlier, shorter length
    (tmp_path / "summary.json").write_text(json.dumps({"rollout_steps": 8}))
    assert finished_note("auto", checkpoint, 9, tmp_path) is None  # longer now: there is more to train
    assert finished_note("auto", checkpoint, 6, tmp_path) == (
        "resume=auto: rollout_step_000008.ckpt is at rollout step 8, past the run's length of 6 rollout steps, and "
        "its run finished there (summary.json); nothing to train, exiting; to train longer, raise "
        "trainer.total_rollout_steps (or trainer.data_epochs)"
    )


def test_checkpoint_paths_are_one_hydra_override_as_written_and_old_names_still_load(tmp_path):
    """`resume=<run>/checkpoints/rollout_step=000004.ckpt` broke Hydra's parser (the `=` in the file name)."""
    directory = tmp_path / "run" / "checkpoints"
    path = checkpoint_path(directory, 4)
    assert path.name == "rollout_step_000004.ckpt"
    assert compose_run_config(f"resume={path}").resume == str(path)
    # Checkpoints named by earlier versions are found beside the new ones, in step order, and rotated with them.
    directory.mkdir(parents=True)
    for name in ("rollout_step=000003.ckpt", "rollout_step_000004.ckpt", "rollout_step=000005.ckpt.tmp"):
        (directory / name).write_bytes(b"not read here")
    assert [p.name for p in list_checkpoints(directory)] == ["rollout_step=000003.ckpt", "rollout_step_000004.ckpt"]
    assert compose_run_config(f"resume='{directory / 'rollout_step=000003.ckpt'}'").resume.endswith("=000003.ckpt")
    prune(directory, keep=1, newest=path)
    assert [p.name for p in list_checkpoints(directory)] == ["rollout_step_000004.ckpt"]


# ------------------------------------------------------------------ directories that cannot be written (item 7)

UNWRITABLE = Path("/sys/kernel")  # sysfs refuses new files to everyone, root included (chmod does not stop root)


def unwritable_here() -> bool:
    return not UNWRITABLE.is_dir() or directory_problem(UNWRITABLE) is None


@pytest.mark.parametrize("where", ["a file", "under a file", "unwritable"])
def test_an_output_dir_that_cannot_be_written_is_refused_in_one_line(tmp_path, where):
    """A raw traceback from Hydra's own mkdir, before train.py's main ran."""
    if where == "unwritable" and unwritable_here():
        pytest.skip(f"{UNWRITABLE} is writable here")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    output_dir, reason = {
        "a file": (a_file, f"{a_file} is a file, not a directory"),
        "under a file": (a_file / "run", f"{a_file} is a file, not a directory"),
        "unwritable": (UNWRITABLE / "lit_ppo_run", f"{UNWRITABLE} (where lit_ppo_run would be made) is not writable ("),
    }[where]
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "mode=plan", f"output_dir={output_dir}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = one_line_refusal(result)
    assert line.startswith(f"error: output_dir={output_dir}: {reason}") and "fix: set output_dir to a" in line, line


def test_an_unwritable_checkpoints_directory_is_refused_before_any_model_loads(tmp_path):
    """It failed after the first checkpointed rollout step with a FileNotFoundError (Lightning's atomic save swallows
    the PermissionError)."""
    if unwritable_here():
        pytest.skip(f"{UNWRITABLE} is writable here")
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").symlink_to(UNWRITABLE)  # checkpoints kept on a store this user cannot write
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"output_dir={out}"], cwd=tmp_path, capture_output=True, text=True
    )
    line = one_line_refusal(result)
    assert line == (
        f"error: the checkpoints of output_dir={out}: {out / 'checkpoints'} (a link to {UNWRITABLE}) is not writable "
        f"(Permission denied); fix: make it writable, or give the run another output_dir"
    )
    assert not (out / "plan.json").exists()


@pytest.mark.parametrize("save", ["lightning", "swallowed"])
def test_a_checkpoint_that_cannot_be_written_mid_run_names_the_reason(save):
    """Lightning's atomic save turns a PermissionError into "upgrade fsspec" across file systems and into nothing on
    one file system (then our rename failed with FileNotFoundError)."""
    if unwritable_here():
        pytest.skip(f"{UNWRITABLE} is writable here")
    from lightning.fabric.utilities.cloud_io import _atomic_save

    trainer = SimpleNamespace(
        is_global_zero=True,
        save_checkpoint=(lambda path: _atomic_save({"weights": 1}, path)) if save == "lightning" else lambda path: None,
        strategy=SimpleNamespace(barrier=lambda name: None, broadcast=lambda obj, src=0: obj),
    )
    with pytest.raises(DirectoryError) as info:
        save_atomic(trainer, checkpoint_path(UNWRITABLE, 3), rank_zero=True)
    assert str(info.value).startswith(
        f"the checkpoint rollout_step_000003.ckpt could not be written: {UNWRITABLE} is not writable (Permission "
        f"denied); fix: make {UNWRITABLE} writable"
    )


def no_space(directory: Path, kept: str) -> str:
    return (
        f"the checkpoint rollout_step_000003.ckpt could not be written: {directory}: no space left on device (ENOSPC); "
        f"earlier checkpoints kept: {kept}; fix: free space in {directory}, then resume=auto"
    )


def run_trainer_on_rank_0(trainer) -> SimpleNamespace:
    """A trainer that saves as `trainer` does on rank 0 of one (Lightning's dump of a checkpoint, then its strategy's
    checkpoint writer), without a fit: a checkpoint of 400 kB of weights and no model."""
    writer = trainer.strategy.checkpoint_io
    state = {"state_dict": {"w": torch.zeros(100_000)}, "lit_ppo": {}}
    return SimpleNamespace(
        is_global_zero=True,
        save_checkpoint=lambda path: writer.save_checkpoint(state, path),
        strategy=SimpleNamespace(barrier=lambda name: None, broadcast=lambda obj, src=0: obj),
    )


def test_a_full_disk_during_a_checkpoint_stops_the_run_in_one_line_with_the_earlier_checkpoints(
    tiny_model_dir, arithmetic_files, tmp_path, monkeypatch
):
    """Issue 55 item 11: a full disk during a checkpoint printed three chained tracebacks and left a partial
    `.ckpt.tmp` on it; and each checkpoint was staged in the system's temporary directory first (Lightning's fsspec
    transaction), so a small `$TMPDIR` failed checkpoints where output_dir had room. The run's own trainer's writer
    (`build_run`), with a temporary directory that does not exist, on a disk that fills during the third checkpoint
    (train.py's run of it: test_train_py_on_a_full_disk_prints_one_line_and_exits_2)."""
    import tempfile

    import lit_ppo.checkpoints
    from lit_ppo.config import RolloutConfig
    from tests.helpers.resume import full_disk_open

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no_such_tmp"))  # what $TMPDIR gives, when it is read
    full = []
    monkeypatch.setattr(
        lit_ppo.checkpoints, "open", full_disk_open("rollout_step_000003.ckpt.tmp", opened=full), raising=False
    )
    built, _, _, _ = build_run(
        tiny_model_dir,
        None,
        arithmetic_files,
        tmp_path / "run",
        rollout=RolloutConfig(engine="hf", max_response_tokens=6, eval_samples_per_prompt=2),
    )
    trainer = run_trainer_on_rank_0(built)
    directory = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        save_atomic(trainer, checkpoint_path(directory, step), rank_zero=True)
    with pytest.raises(DirectoryError) as info:
        save_atomic(trainer, checkpoint_path(directory, 3), rank_zero=True)
    assert str(info.value) == no_space(directory, "rollout_step_000001.ckpt, rollout_step_000002.ckpt")
    [partial] = full
    assert partial.written == 4096  # the disk took what fitted; that partial file is removed
    assert sorted(p.name for p in directory.iterdir()) == ["rollout_step_000001.ckpt", "rollout_step_000002.ckpt"]
    assert all(checkpoint_problem(p) is None for p in list_checkpoints(directory))


def test_a_full_disk_at_the_checkpoints_flush_is_named_the_same_way(tmp_path, monkeypatch):
    """A full disk (or an NFS quota) may show only when the written file is flushed to disk (fsync)."""
    import errno

    import lit_ppo.atomic

    directory = tmp_path / "checkpoints"
    write_checkpoints(directory, [1, 2])

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lit_ppo.atomic.os, "fsync", full)
    trainer = SimpleNamespace(
        is_global_zero=True,
        save_checkpoint=lambda path: Path(path).write_bytes(b"a checkpoint, written"),
        strategy=SimpleNamespace(barrier=lambda name: None, broadcast=lambda obj, src=0: obj),
    )
    with pytest.raises(DirectoryError) as info:
        save_atomic(trainer, checkpoint_path(directory, 3), rank_zero=True)
    assert str(info.value) == no_space(directory, "rollout_step_000001.ckpt, rollout_step_000002.ckpt")
    assert sorted(p.name for p in directory.iterdir()) == ["rollout_step_000001.ckpt", "rollout_step_000002.ckpt"]


FULL_DISK_RUN = """
import runpy, sys
import lit_ppo.checkpoints
from tests.helpers.resume import full_disk_open

lit_ppo.checkpoints.open = full_disk_open("rollout_step_000002.ckpt.tmp")
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_train_py_on_a_full_disk_prints_one_line_and_exits_2(tmp_path):
    """The README's promise, at train.py's level: one line (exit 2), no traceback, the earlier checkpoint kept."""
    out = tmp_path / "run"
    overrides = [
        "rollout.engine=hf",
        "trainer.total_rollout_steps=2",
        "trainer.checkpoint_every=1",
        "trainer.eval_every=0",
        "ppo.rollout_batch_size=8",
        "ppo.train_batch_size=32",
        "ppo.micro_train_batch_size=16",
        "model.warm_start.steps=20",
        "data.n_train=16",
        "data.n_eval=4",
        "rollout.eval_samples_per_prompt=1",
        f"output_dir={out}",
    ]
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK_RUN, *overrides], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    # (from "error: " on: the progress bar's line may precede it on the same line, issue 55 item 15)
    [line] = [line[line.index("error: ") :] for line in re.split(r"[\r\n]", result.stderr) if "error: " in line]
    directory = out / "checkpoints"
    assert line == (
        f"error: the checkpoint rollout_step_000002.ckpt could not be written: {directory}: no space left on device "
        f"(ENOSPC); earlier checkpoints kept: rollout_step_000001.ckpt; fix: free space in {directory}, then "
        "resume=auto"
    )
    assert sorted(p.name for p in directory.iterdir()) == ["rollout_step_000001.ckpt"]


SAVE_ON_TWO_RANKS = """
import datetime, os, sys
from pathlib import Path
import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
from lit_ppo.checkpoints import checkpoint_path, save_atomic

class SaveAfterTheFirstStep(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        save_atomic(trainer, checkpoint_path(Path(sys.argv[1]), 1), rank_zero=trainer.is_global_zero)

trainer = L.Trainer(
    accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, callbacks=[SaveAfterTheFirstStep()],
    strategy=DDPStrategy(process_group_backend="gloo", timeout=datetime.timedelta(seconds=20)),
)
try:
    trainer.fit(BoringModel())
    outcome = "finished"
except BaseException as error:
    outcome = f"{type(error).__name__}: {error}"
Path(sys.argv[2]).write_text(outcome)
os._exit(0)  # at once: a rank left in a collective is the failure this shows, not something to wait for
"""


def test_a_checkpoint_rank_0_cannot_write_stops_every_rank_in_one_line(tmp_path):
    """Under DDP only rank 0 writes the checkpoint: its DirectoryError reaches every rank (a broadcast of the outcome),
    so the run stops everywhere with the same line, where the other ranks used to wait for rank 0 in their next
    collective until the process group's timeout (then a gloo error: 20 s here, 30 min by default). Two CPU ranks of
    a real Lightning DDP trainer, started as torchrun would."""
    if unwritable_here():
        pytest.skip(f"{UNWRITABLE} is writable here")
    from tests.helpers import free_port

    script = tmp_path / "save_on_two_ranks.py"
    script.write_text(SAVE_ON_TWO_RANKS)
    port, ranks = str(free_port()), []
    for rank in range(2):
        environment = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        )
        command = [sys.executable, str(script), str(UNWRITABLE), str(tmp_path / f"rank{rank}.txt")]
        ranks.append(subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = [rank.communicate(timeout=300)[0].decode(errors="replace") for rank in ranks]
    outcomes = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    expected = (
        f"DirectoryError: the checkpoint rollout_step_000001.ckpt could not be written: {UNWRITABLE} is not writable "
        f"(Permission denied); fix: make {UNWRITABLE} writable (or free space there), then resume=auto"
    )
    assert outcomes == [expected, expected], logs


def test_a_checkpoint_under_a_name_of_ones_own_resumes(tmp_path):
    """`resume=<dir>/start.ckpt` (a copy under another name, as a user or a requeue script makes): its rollout step is
    not in its name, and nothing that reads the name may fail on it."""
    from lit_ppo.checkpoints import step_of
    from lit_ppo.resume import finished_note

    copy = write_checkpoint(tmp_path / "start.ckpt")
    assert step_of(copy) is None and step_of(tmp_path / "rollout_step_000004.ckpt") == 4
    assert step_of(tmp_path / "rollout_step=000004.ckpt") == 4  # an earlier version's name
    assert finished_note(str(copy), copy, 2, tmp_path) is None
    config = compose_run_config("trainer.total_rollout_steps=2")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    write_checkpoints(tmp_path / "checkpoints", [1])
    check_run_directory(dataclasses.replace(config, resume=str(copy)), tmp_path)
