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
