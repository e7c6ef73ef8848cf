"""The trainer's client of its rollout workers (lit_ppo/rollout/workers/client.py), without a worker process: a
worker killed during a push is named dead, not stuck. Its runs with workers are tests/rollout/test_async.py's."""

from __future__ import annotations

import time

import pytest
import torch

from lit_ppo.rollout.workers.client import RolloutWorkers


def test_a_spawned_worker_killed_during_a_push_is_named_dead_not_stuck(tmp_path, monkeypatch):
    """A worker SIGKILLed during a weight push: the push's broadcast fails as its sockets close, moments before the
    trainer's `poll` sees the child's exit. The push waits that moment (SpawnedLaunch.settle_s) and names the dead
    worker; it used to say "a rollout worker is stuck" (bench/random_kills.py's worker kills at k = 1)."""
    from lit_ppo.contract import WeightUpdate
    from lit_ppo.errors import RolloutWorkerError
    from lit_ppo.rollout.weight_transfer import backend as weight_transfer
    from lit_ppo.rollout.workers import client
    from lit_ppo.rollout.workers.launch import SpawnedLaunch

    class Store:
        def set(self, key, value):
            pass

        def check(self, keys):
            return False

    class KilledDuringThePush:
        """A child whose exit `poll` sees 0.3 s after the push failed (the race), with SIGKILL's code."""

        pid, exits_at = 4242, float("inf")

        def poll(self):
            return -9 if time.monotonic() >= self.exits_at else None

    child = KilledDuringThePush()

    def broadcast(group, flat):  # the peer's connection closes: gloo fails at once
        child.exits_at = time.monotonic() + 0.3
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(weight_transfer, "broadcast", broadcast)
    launch = SpawnedLaunch(
        store=Store(), host="127.0.0.1", workers=1, log_dir=tmp_path, devices_per_worker=1, trainer_devices=1
    )
    launch.procs = [child]
    workers = object.__new__(RolloutWorkers)  # the trainer's side alone: no store server, no worker process
    workers.store, workers.launch, workers.workers, workers.push_timeout_s = Store(), launch, 1, 60.0
    workers.sync_client = client.WorkerSyncClient(workers)
    workers.transfer = weight_transfer.GlooTrainerWeightTransferEngine(client=workers.sync_client, bucket_bytes=2**20)
    with pytest.raises(
        RolloutWorkerError,
        match=r"rollout worker 0 \(pid 4242\) exited with code -9 while the trainer waited for the weight push",
    ):
        workers.update_weights(WeightUpdate(3, tensors=[("w", torch.zeros(4))], metadata=[("w", torch.float32, (4,))]))
