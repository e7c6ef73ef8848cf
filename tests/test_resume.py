"""Checkpoints, resume after a crash, and non-finite updates."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lit_ppo.checkpoints import RolloutCheckpoint, checkpoint_path, list_checkpoints
from lit_ppo.errors import ConfigError, NonFiniteUpdatesError
from lit_ppo.resume import check_run_directory, checkpoint_problem, resolve_resume
from tests.helpers import ROOT, build_run, compose_run_config
from tests.helpers.resume import (
    assert_same_weights,
    checkpointed_run,
    counters,
    random_kills,
    write_checkpoint,
)


def run_in_process(paths, engine, tmp_path, steps, resume_from=None, every=1, crash_after=None):
    # 64 prompts, rollout batch 16 -> 4 rollout steps per data epoch; ppo_epochs 2 exercises the shuffle state.
    _, module, datamodule = checkpointed_run(
        paths,
        engine,
        tmp_path,
        every=every,
        keep=2,
        crash_after=crash_after,
        resume_from=resume_from,
        total_rollout_steps=steps,
        ppo_epochs=2,
        kl_coef=0.05,
        rollout_batch_size=16,
        train_batch_size=16,
        micro_train_batch_size=8,
    )
    return module, datamodule


@pytest.fixture
def paths(tiny_model_dir, arithmetic_files):
    return tiny_model_dir, arithmetic_files


def test_resume_at_a_data_epoch_boundary_matches_an_uninterrupted_run(paths, engine, tmp_path):
    full, _ = run_in_process(paths, engine, tmp_path / "full", steps=6)
    run_in_process(paths, engine, tmp_path / "split", steps=6, every=4, crash_after=5)  # crashes inside data epoch 1
    # Resumed from the checkpoint at rollout step 4: exactly the data-epoch boundary.
    boundary = checkpoint_path(tmp_path / "split" / "checkpoints", 4)
    assert boundary.exists()
    # The checkpoint holds the trained tensors, not the frozen reference (loaded from model_dir on resume).
    saved = torch.load(boundary, map_location="cpu", weights_only=False)["state_dict"]
    assert any(k.startswith("actor.") for k in saved) and any(k.startswith("critic.") for k in saved)
    assert not [k for k in saved if k.startswith("reference.")]
    resumed, _ = run_in_process(paths, engine, tmp_path / "split", steps=6, resume_from=boundary)
    # The data epoch each rollout step's batch came from, as the product records it (metrics.csv's data_epoch):
    # 4 rollout steps per data epoch, and the resumed steps 5 and 6 continue the prompt stream in data epoch 1.
    assert [r["data_epoch"] for r in resumed.history] == [r["data_epoch"] for r in full.history] == [0] * 4 + [1] * 2
    # 16 prompts x 4 samples x 2 epochs / 16 = 8 optimizer steps per rollout step.
    assert counters(resumed) == counters(full) == {"rollout_step": 6, "actor": 48, "critic": 48, "samples": 384}
    assert_same_weights(resumed.actor.state_dict(), full.actor.state_dict())
    assert_same_weights(resumed.reference.state_dict(), full.reference.state_dict())
    assert [r["rollout/reward_mean"] for r in resumed.history] == [r["rollout/reward_mean"] for r in full.history]


@pytest.mark.slow  # make test: test_sigkill_during_checkpoint_write_leaves_the_previous_one_resumable, the exact in-process
# resumes here and test_ddp.py's train.py resume=auto; make test-slow: test_random_kills.py's 13 cases
def test_sigkill_then_resume_auto_matches_an_uninterrupted_run(tmp_path):
    """`train.py` SIGKILLed as its checkpoint of rollout step 2 appears, then `resume=auto`: bench/random_kills.py's
    proof at that fixed point (weights bitwise, each rollout step's prompts), the same counters, and metrics.csv with
    no gap or repeat."""
    case = random_kills.Case(("trainer.total_rollout_steps=4", "ppo.ppo_epochs=2"), steps=4)
    result = random_kills.run_case("colocated, 4 steps", 0, 0, tmp_path, case=case, at=("checkpoint 2",))
    (kill,) = result.kills
    assert kill.done and kill.checkpoint_left != "rollout_step_000004.ckpt", f"killed too late:\n{result.report()}"
    assert not result.findings, result.report()
    full, crashed = tmp_path / "uninterrupted", tmp_path / "killed"
    a = torch.load(checkpoint_path(full / "checkpoints", 4), weights_only=False)["lit_ppo"]
    b = torch.load(checkpoint_path(crashed / "checkpoints", 4), weights_only=False)["lit_ppo"]
    for key in ("rollout_step", "actor_optimizer_steps", "critic_optimizer_steps", "samples_seen"):
        assert a[key] == b[key], key
    rows = (crashed / "metrics.csv").read_text().splitlines()
    assert (
        len(rows) == 1 + 1 + 4
    )  # header + the evaluation before any update + one row per rollout step: no gap, no repeat


KILL_DURING_WRITE = """
import os, signal, sys
from pathlib import Path
from lit_ppo.checkpoints import save_atomic

class Strategy:
    def barrier(self, name): pass

class CrashingTrainer:
    is_global_zero = True
    strategy = Strategy()
    def save_checkpoint(self, path):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # dies in the middle of the write

save_atomic(CrashingTrainer(), Path(sys.argv[1]), rank_zero=True)
"""


def test_sigkill_during_checkpoint_write_leaves_the_previous_one_resumable(paths, engine, tmp_path):
    module, _ = run_in_process(paths, engine, tmp_path, steps=2)
    directory = tmp_path / "checkpoints"
    before = list_checkpoints(directory)
    assert [p.name for p in before] == ["rollout_step_000001.ckpt", "rollout_step_000002.ckpt"]
    size = before[-1].stat().st_size
    result = subprocess.run([sys.executable, "-c", KILL_DURING_WRITE, str(checkpoint_path(directory, 3))], cwd=ROOT)
    assert result.returncode == -signal.SIGKILL
    assert (directory / "rollout_step_000003.ckpt.tmp").exists()  # the torn write ...
    assert list_checkpoints(directory) == before and before[-1].stat().st_size == size  # ... is never picked up
    assert resolve_resume("auto", directory) == before[-1]
    resumed, _ = run_in_process(paths, engine, tmp_path, steps=3, resume_from=resolve_resume("auto", directory))
    assert resumed.rollout_step == 3 and resumed.actor_optimizer_steps == 3 * 8  # 16 x 4 x 2 / 16 per step


def truncate(path: Path, keep: float = 0.5) -> int:
    """Cut the file at `path` to `keep` of its length, as a full disk or a killed copy leaves it; its new size."""
    size = int(path.stat().st_size * keep)
    with open(path, "r+b") as f:
        f.truncate(size)
    return size


def cut_short(name: str, size: int) -> str:
    return (
        f"{name} is damaged: its {size} bytes end without the zip directory a checkpoint ends with (cut short, by a "
        "full disk or a killed copy?)"
    )


def test_resume_auto_passes_over_a_truncated_newest_checkpoint_with_one_warning(tmp_path, capsys):
    """Issue 55 item 10: resume=auto picked a checkpoint cut short, started the engine and failed on it with a 40-line
    traceback, on every requeue, never trying the intact one before it. Decided from the files alone (no model)."""
    directory = tmp_path / "checkpoints"
    older, newest = (write_checkpoint(checkpoint_path(directory, step)) for step in (2, 4))
    assert checkpoint_problem(older) is None and checkpoint_problem(newest) is None
    size = truncate(newest)
    assert resolve_resume("auto", directory) == older and capsys.readouterr().out == ""  # ranks > 0: no line
    # The run directory's check lets it through: the damaged newer one does not make the intact one "older than the
    # directory's latest", whether resume=auto chose it or the user named it.
    config = compose_run_config()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    check_run_directory(dataclasses.replace(config, resume="auto"), tmp_path)
    check_run_directory(dataclasses.replace(config, resume=str(older)), tmp_path)
    # Rank 0 says so in one line and sets the damaged one aside: the rotation keeps intact checkpoints, a requeued
    # job does not pass over it again, and nothing is deleted.
    assert resolve_resume("auto", directory, announce=True) == older
    assert capsys.readouterr().out.splitlines() == [
        f"warning: resume=auto: {cut_short(newest.name, size)}; set aside as <name>.damaged; resuming from "
        "rollout_step_000002.ckpt, the newest intact checkpoint (the rollout steps after 2 are trained again)"
    ]
    assert list_checkpoints(directory) == [older] and newest.with_name(newest.name + ".damaged").stat().st_size == size
    # None left to resume from: one line naming each.
    again = write_checkpoint(checkpoint_path(directory, 4))
    older_size, again_size = truncate(older, keep=0.99), truncate(again)
    with pytest.raises(ConfigError) as info:
        resolve_resume("auto", directory)
    assert str(info.value) == (
        f"resume=auto: no checkpoint in {directory} can be resumed from: {cut_short(again.name, again_size)}; "
        f"{cut_short(older.name, older_size)}; fix: put an intact checkpoint there, or start a new run in another "
        "output_dir"
    )


def test_a_checkpoint_that_cannot_be_read_is_refused_not_passed_over_for_an_older_one(tmp_path, monkeypatch):
    """A read error (a file system's EIO or ESTALE, permissions) is not damage: resume=auto passing over an intact
    newest checkpoint for an older one would train steps again and let the rotation delete the good file. And the check
    reads the object record alone (no torch.load, no mmap of a checkpoint of any size)."""
    import errno
    import zipfile

    from lit_ppo import resume
    from lit_ppo.errors import DirectoryError

    directory = tmp_path / "checkpoints"
    older, newest = (write_checkpoint(checkpoint_path(directory, step)) for step in (2, 4))
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("the check loads the checkpoint"))
    assert resolve_resume("auto", directory) == newest

    real_zip_file = zipfile.ZipFile

    def unreadable(path, *args, **kwargs):
        if Path(path) == newest:
            raise OSError(errno.EIO, "Input/output error")
        return real_zip_file(path, *args, **kwargs)

    monkeypatch.setattr(resume.zipfile, "ZipFile", unreadable)
    with pytest.raises(DirectoryError) as info:
        resolve_resume("auto", directory)
    assert str(info.value).startswith(f"{newest}: cannot be read (Input/output error): not a damaged checkpoint")
    assert "fix: make it readable" in str(info.value) and "\n" not in str(info.value)


def test_an_explicit_resume_of_a_truncated_checkpoint_is_refused_naming_the_intact_one(tmp_path):
    """resume=<path> to a damaged file is refused, not passed over: the user named it. The line names the way on."""
    directory = tmp_path / "run" / "checkpoints"
    older, newest = (write_checkpoint(checkpoint_path(directory, step)) for step in (2, 4))
    size = truncate(newest)

    def refusal(path: Path, run_directory: Path = directory) -> str:
        with pytest.raises(ConfigError) as info:
            resolve_resume(str(path), run_directory)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert refusal(newest) == (
        f"resume={newest}: {cut_short(newest.name, size)}; fix: resume=auto, which resumes from "
        f"rollout_step_000002.ckpt, the newest intact checkpoint in {directory}"
    )
    # A checkpoint of another run's directory: its intact neighbour, by path.
    assert refusal(newest, tmp_path / "other" / "checkpoints").endswith(
        f"; fix: resume={older}, the newest intact checkpoint beside it"
    )
    alone = tmp_path / "copy" / "start.ckpt"
    alone.parent.mkdir()
    alone.write_bytes(newest.read_bytes())
    assert refusal(alone).endswith(
        "; fix: resume from another checkpoint of this run, or start a new run in another output_dir"
    )
    # Refused before the run writes anything into its directory, and before any model loads.
    config = dataclasses.replace(compose_run_config(), resume=str(newest))
    with pytest.raises(ConfigError, match="is damaged: its"):
        check_run_directory(config, tmp_path / "run")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_file_that_is_not_a_lit_ppo_checkpoint_is_refused_in_one_line(tmp_path):
    """A file that loads (a bare state_dict, another program's checkpoint) used to fail in on_load_checkpoint with a
    KeyError traceback, after the engine's start."""
    bare = tmp_path / "model.pt"
    torch.save({"weight": torch.zeros(3), "bias": torch.zeros(1)}, bare)
    with pytest.raises(ConfigError) as info:
        resolve_resume(str(bare), tmp_path / "checkpoints")
    assert str(info.value) == (
        f"resume={bare}: model.pt is not a lit-ppo checkpoint (it holds the keys ['bias', 'weight'], no 'lit_ppo' "
        "state: another program's file?); fix: resume from another checkpoint of this run, or start a new run in "
        "another output_dir"
    )
    torch.save([1, 2], bare)
    with pytest.raises(ConfigError, match=r"model.pt is not a lit-ppo checkpoint \(it holds a list, "):
        resolve_resume(str(bare), tmp_path / "checkpoints")


@pytest.mark.slow
def test_train_py_resumes_from_the_intact_checkpoint_and_refuses_a_truncated_one_in_one_line(tmp_path):
    """At train.py's level, without any model: a warning line then the older checkpoint's "finished" line (exit 0;
    the run finished at the intact one), and resume=<the truncated file> refused in one line (exit 2)."""
    from lit_ppo.run.prepare import preflight

    out = tmp_path / "run"
    overrides = ["trainer.total_rollout_steps=1", "model.warm_start.steps=20", "data.n_train=64", "data.n_eval=8"]
    config = preflight(compose_run_config(*overrides)).config  # as the run wrote it: ppo.packing resolved
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    (out / "summary.json").write_text(json.dumps({"rollout_steps": 1}))
    write_checkpoint(checkpoint_path(out / "checkpoints", 1))
    newest = write_checkpoint(checkpoint_path(out / "checkpoints", 2))
    size = truncate(newest)

    def train(resume: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "train.py", *overrides, f"output_dir={out}", f"resume={resume}"]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)

    resumed = train("auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = [line for line in resumed.stdout.splitlines() if "resume=auto" in line]
    assert lines == [
        f"warning: resume=auto: {cut_short(newest.name, size)}; set aside as <name>.damaged; resuming from "
        "rollout_step_000001.ckpt, the newest intact checkpoint (the rollout steps after 1 are trained again)",
        "resume=auto: rollout_step_000001.ckpt is at the end of the run (rollout step 1 of 1), and its run finished "
        "there (summary.json); nothing to train, exiting; to train longer, raise trainer.total_rollout_steps (or "
        "trainer.data_epochs)",
    ], resumed.stdout[-3000:]
    newest.with_name(newest.name + ".damaged").rename(newest)  # set aside by resume=auto: put back by hand
    assert list_checkpoints(out / "checkpoints")[-1] == newest
    refused = train(str(newest))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == [
        f"error: resume={newest}: {cut_short(newest.name, size)}; fix: resume=auto, which resumes from "
        f"rollout_step_000001.ckpt, the newest intact checkpoint in {out / 'checkpoints'}"
    ]


def test_nonfinite_loss_is_skipped_and_counted(paths, engine, tmp_path, monkeypatch):
    from lit_ppo import algorithms  # the losses' aggregation, where lit_ppo.training.loss reads it

    original = algorithms.aggregate_loss
    calls = {"n": 0}

    def nan_once(loss, *args, **kwargs):
        calls["n"] += 1
        value = original(loss, *args, **kwargs)
        return value * float("nan") if calls["n"] == 1 else value  # the first micro-batch's loss is NaN

    monkeypatch.setattr(algorithms, "aggregate_loss", nan_once)
    # A reward that varies between samples, so a random policy gets non-zero advantages and gradients.
    trainer, module, datamodule, plan = build_run(
        paths[0],
        engine,
        paths[1],
        tmp_path,
        total_rollout_steps=1,
        reward_fn=lambda p, responses, r, e: [len(x) % 3 for x in responses],
    )
    before = {k: v.clone() for k, v in module.actor.state_dict().items()}
    trainer.fit(module, datamodule=datamodule)
    assert module.skipped_updates == 1
    assert module.actor_optimizer_steps == plan.counts.optimizer_steps_per_rollout_step  # planned steps still accounted
    assert module.history[-1]["actor/skipped_updates"] == 1
    assert all(torch.isfinite(v).all() for v in module.actor.state_dict().values())
    assert any(not torch.equal(before[k], v) for k, v in module.actor.state_dict().items())  # later updates applied


def test_repeated_nonfinite_losses_stop_the_run_with_a_checkpoint(paths, engine, tmp_path, monkeypatch):
    from lit_ppo import algorithms  # the losses' aggregation, where lit_ppo.training.loss reads it

    original = algorithms.aggregate_loss
    monkeypatch.setattr(algorithms, "aggregate_loss", lambda *a, **k: original(*a, **k) * float("nan"))
    trainer, module, datamodule, _ = build_run(
        paths[0],
        engine,
        paths[1],
        tmp_path,
        total_rollout_steps=3,
        advantage_estimator="grpo",
        kl_coef=0.0,
        callbacks=[RolloutCheckpoint(tmp_path / "checkpoints", every=0, keep=2)],
    )
    with pytest.raises(NonFiniteUpdatesError, match="3 optimizer steps in a row"):
        trainer.fit(module, datamodule=datamodule)
    saved = list_checkpoints(tmp_path / "checkpoints")
    assert len(saved) == 1
    state = torch.load(saved[0], weights_only=False)["lit_ppo"]
    # The failing step's start (issue 36 item 5): its skipped updates belong to the attempt a resume makes again.
    assert saved[0].name == "rollout_step_000000.ckpt"
    assert state["skipped_updates"] == 0 and state["actor_optimizer_steps"] == 0


def run_until_done_or_failed(
    paths, engine, out, datamodule_class, *, resume_from=None, callbacks=(), steps=2, **rollout
):
    """`steps` rollout steps of 16 prompts x 4 samples (8 optimizer steps each), a checkpoint only at the end or on an
    error; `rollout`: RolloutConfig settings beside the tests' (rollout.max_logprob_abs_diff)."""
    from lit_ppo.config import RolloutConfig

    checkpoints = RolloutCheckpoint(out / "checkpoints", every=0, keep=2)
    trainer, module, datamodule, plan = build_run(
        paths[0],
        engine,
        paths[1],
        out,
        total_rollout_steps=steps,
        rollout=RolloutConfig(max_response_tokens=6, eval_samples_per_prompt=2, **rollout),
        callbacks=[checkpoints, *callbacks],
        datamodule_class=datamodule_class,
        reward_fn=lambda p, responses, r, e: [len(x) % 3 for x in responses],  # differs within groups: updates
        advantage_estimator="grpo",
        kl_coef=0.0,
        ppo_epochs=2,
        rollout_batch_size=16,
        train_batch_size=16,
        micro_train_batch_size=8,
    )
    torch.manual_seed(0)
    ckpt = str(resume_from) if resume_from else None
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=False)
    return module, plan


def resume_after(error, paths, engine, tmp_path, make_failing, fix):
    """(the uninterrupted run, the run resumed from the exception checkpoint, the failing run's batches, the resumed
    run's batches): a run that fails with `error` (set up by `make_failing(out)` -> (data module class, callbacks,
    rollout settings)), then resumed from its checkpoint with `fix` (rollout settings)."""
    from tests.helpers.resume import recording_datamodule

    full, plan = run_until_done_or_failed(paths, engine, tmp_path / "full", recording_datamodule())
    failing_class, callbacks, settings = make_failing(tmp_path / "failed")
    with pytest.raises(error):
        run_until_done_or_failed(paths, engine, tmp_path / "failed", failing_class, callbacks=callbacks, **settings)
    [saved] = list_checkpoints(tmp_path / "failed" / "checkpoints")
    resumed_class = recording_datamodule()
    resumed, _ = run_until_done_or_failed(paths, engine, tmp_path / "failed", resumed_class, resume_from=saved, **fix)
    return full, resumed, failing_class.batches, resumed_class.batches, plan, saved


def test_resume_from_a_rollout_mismatch_checkpoint_trains_the_failing_steps_prompts(paths, engine, tmp_path):
    """Issue 36 item 5: the checkpoint written on RolloutMismatchError at rollout step 2 (index 1) is the step's start
    (the data module's position included): resumed with the fix the error names (rollout.max_logprob_abs_diff=null),
    the run trains step 2's prompts, ends with the planned counts and the uninterrupted run's weights. It used to hold
    the data position after the step, and the resumed run skipped the step's prompts."""
    from lit_ppo.errors import RolloutMismatchError
    from tests.helpers.resume import recording_datamodule

    full, resumed, failed, again, plan, saved = resume_after(
        RolloutMismatchError,
        paths,
        engine,
        tmp_path,
        lambda out: (recording_datamodule(mismatch_at=1), [], {}),
        {"max_logprob_abs_diff": None},
    )
    assert saved.name == "rollout_step_000001.ckpt"
    assert [b.rollout_step for b in failed] == [0, 1] and [b.rollout_step for b in again] == [1]
    assert again[0].dataset_indices == failed[1].dataset_indices  # the failing step's prompts, trained again
    planned = plan.counts.optimizer_steps_per_rollout_step * 2
    assert counters(resumed) == counters(full) == {"rollout_step": 2, "actor": planned, "critic": 0, "samples": 128}
    assert_same_weights(resumed.actor.state_dict(), full.actor.state_dict())


@pytest.mark.parametrize(
    "applied", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["diverged-at-the-steps-start", "after-2-updates"]
)
def test_resume_from_a_nonfinite_checkpoint_trains_the_failing_steps_prompts(
    paths, engine, tmp_path, monkeypatch, applied
):
    """Issue 36 item 5: non-finite losses from rollout step 2's optimizer step `applied` + 1 on stop the run after
    3 in a row (NonFiniteUpdatesError); its checkpoint holds step 2's start for the data position, counters, random
    streams and learning-rate schedules, so the resumed run (losses finite again: the lowered learning rate) trains step
    2's prompts and ends with the planned optimizer steps. Where the step had applied no update the checkpoint is its
    start exactly and the resumed run ends with the uninterrupted run's weights."""
    from lit_ppo.errors import NonFiniteUpdatesError
    from tests.helpers.resume import NonFiniteLossesFrom, recording_datamodule

    per_step = 8  # 16 prompts x 4 samples x 2 epochs / 16

    def failing(out):
        return recording_datamodule(), [NonFiniteLossesFrom(monkeypatch, per_step + applied)], {}

    full, resumed, failed, again, plan, saved = resume_after(
        NonFiniteUpdatesError, paths, engine, tmp_path, failing, {}
    )
    assert plan.counts.optimizer_steps_per_rollout_step == per_step
    assert saved.name == "rollout_step_000001.ckpt"
    state = torch.load(saved, weights_only=False)
    assert state["lit_ppo"]["actor_optimizer_steps"] == per_step and state["lit_ppo"]["skipped_updates"] == 0
    assert again[0].rollout_step == 1 and again[0].dataset_indices == failed[1].dataset_indices
    assert counters(resumed) == counters(full) == {"rollout_step": 2, "actor": 16, "critic": 0, "samples": 128}
    assert resumed.skipped_updates == 0
    if applied == 0:
        assert_same_weights(resumed.actor.state_dict(), full.actor.state_dict())
    else:  # the models kept the step's 2 updates: not the uninterrupted run's
        assert any(not torch.equal(v, full.actor.state_dict()[k]) for k, v in resumed.actor.state_dict().items())


def test_a_finished_run_extended_on_resume_trains_the_added_steps(paths, engine, tmp_path):
    """The last checkpoint of a run whose trainer.checkpoint_every does not divide its length: written after the last
    step, not once Lightning's loop has ended (which records its one epoch as done: the extended run trained nothing
    and ended "finished" at the old length)."""
    from tests.helpers.resume import recording_datamodule

    run_until_done_or_failed(paths, engine, tmp_path, recording_datamodule(), steps=1)
    [last] = list_checkpoints(tmp_path / "checkpoints")
    assert last.name == "rollout_step_000001.ckpt"
    extended_class = recording_datamodule()
    extended, plan = run_until_done_or_failed(paths, engine, tmp_path, extended_class, resume_from=last, steps=2)
    assert [b.rollout_step for b in extended_class.batches] == [1]
    assert (
        extended.rollout_step == 2
        and extended.actor_optimizer_steps == 2 * plan.counts.optimizer_steps_per_rollout_step
    )
