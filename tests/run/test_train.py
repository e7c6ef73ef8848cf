"""lit_ppo/run/train.py: what the run's own glue adds to the lines that stop it."""

from __future__ import annotations

from lit_ppo.checkpoints import checkpoint_path
from lit_ppo.run.train import lost_step_note


def test_a_rollout_workers_failure_mid_run_names_the_step_lost_the_checkpoint_on_disk_and_resume_auto(tmp_path):
    """A rollout worker (a spawned one, or a server given by URL) that dies during the rollout steps stops the run with
    its line, and `train` appends what that cost and how to continue: the step it stopped in, the newest checkpoint on
    disk (checkpoints may be every few steps), resume=auto, and for given servers that they must run again first."""
    directory = tmp_path / "checkpoints"
    assert lost_step_note(0, 30, directory, given_servers=False) == (
        "the run stopped in rollout step 1 of 30, which is lost; no checkpoint was written yet "
        "(trainer.checkpoint_every); resume=auto starts the run again"
    )
    directory.mkdir()
    for step in (2, 4):
        checkpoint_path(directory, step).write_bytes(b"")
    (directory / "rollout_step_000006.ckpt.tmp").write_bytes(b"")  # a partial one is not a checkpoint
    newest = checkpoint_path(directory, 4)
    assert lost_step_note(5, 30, directory, given_servers=True) == (
        f"the run stopped in rollout step 6 of 30, which is lost; the last checkpoint on disk is {newest}; continue "
        "from it with resume=auto once the servers given by rollout.workers.server_urls run again"
    )
    assert lost_step_note(30, 30, directory, given_servers=False) == (  # after the last step's updates
        f"the run stopped after its last rollout step (30); the last checkpoint on disk is {newest}; continue from it "
        "with resume=auto"
    )


def test_train_ends_a_rollout_workers_failure_during_the_steps_with_the_note(tmp_path, monkeypatch):
    """`train` appends `lost_step_note` to the RolloutWorkerError that stops `fit` once the workers have started (here
    a given server's, raised by a stand-in `fit` after the workers' client was built): the run's last checkpoint and
    resume=auto, once the servers run again."""
    import lightning as L
    import pytest

    from lit_ppo.errors import RolloutWorkerError
    from lit_ppo.run.train import train
    from tests.helpers import FIXTURE_MODEL, compose_run_config

    class Client:  # the workers' client that `fit` built
        def close(self):
            pass

    failure = (
        "trainer: vLLM server 0 at http://127.0.0.1:8000 (given by rollout.workers.server_urls; its log is its own) "
        "failed a rollout batch's request"
    )

    def failing_fit(trainer, module, datamodule=None, **_):
        datamodule.engine = Client()
        module.rollout_step = 2  # two steps completed, the third lost
        checkpoint_path(tmp_path / "checkpoints", 2).parent.mkdir(parents=True)
        checkpoint_path(tmp_path / "checkpoints", 2).write_bytes(b"")
        raise RolloutWorkerError(failure)

    monkeypatch.setattr(L.Trainer, "fit", failing_fit)
    config = compose_run_config(
        *FIXTURE_MODEL,
        "model.warm_start.enabled=false",
        "rollout.mode=disaggregated",
        "rollout.workers.launch=server",
        "rollout.workers.server_urls=[http://127.0.0.1:8000]",
        "trainer.total_rollout_steps=4",
        f"output_dir={tmp_path}",
    )
    with pytest.raises(RolloutWorkerError) as info:
        train(config, tmp_path)
    assert str(info.value) == (
        f"{failure}; the run stopped in rollout step 3 of 4, which is lost; the last checkpoint on disk is "
        f"{checkpoint_path(tmp_path / 'checkpoints', 2)}; continue from it with resume=auto once the servers given by "
        "rollout.workers.server_urls run again"
    )
