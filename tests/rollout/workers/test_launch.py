"""How rollout workers start (lit_ppo/rollout/workers/launch.py): the devices each spawned worker gets."""

from __future__ import annotations

import pytest

from lit_ppo.errors import ConfigError, RolloutWorkerError


def test_a_worker_gets_the_devices_after_the_trainers_or_shares_the_trainers_first_with_devices_0():
    """rollout.workers.devices: worker i's CUDA_VISIBLE_DEVICES among the visible ids; 0 puts every worker on the
    trainer's first device (one GPU for both); too few devices is one line naming the fix; a negative count is refused."""
    from lit_ppo.config import WorkersConfig
    from lit_ppo.rollout.workers.launch import worker_device_ids

    ids = ["4", "5", "6", "7"]
    assert [worker_device_ids(ids, w, 1, 2) for w in (0, 1)] == ["6", "7"]
    assert worker_device_ids(ids, 0, 2, 2) == "6,7"
    assert [worker_device_ids(ids, w, 0, 2) for w in (0, 1)] == ["4", "4"]
    assert worker_device_ids(["0"], 0, 0, 1) == "0"
    with pytest.raises(RolloutWorkerError, match=r"needs devices 1\.\.1 after the trainer's 1, but 1 are visible"):
        worker_device_ids(["0"], 0, 1, 1)
    assert WorkersConfig(devices=0).devices == 0
    with pytest.raises(
        ConfigError,
        match=r"rollout.workers.devices=-1 must be a whole number >= 0; fix: .* or 0 to share the trainer's",
    ):
        WorkersConfig(devices=-1)
