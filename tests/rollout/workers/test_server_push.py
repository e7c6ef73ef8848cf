"""The weight push to vLLM servers (lit_ppo/rollout/workers/server_push.py), without a server: a failed call named
as that call while a failed push settles. The pushes to real servers are in test_servers.py (slow)."""

from __future__ import annotations

import pytest

from lit_ppo.errors import RolloutWorkerError
from lit_ppo.rollout.workers.server_http import Server
from lit_ppo.rollout.workers.server_push import ServerSyncClient
from lit_ppo.rollout.workers.servers import ServerWorkers
from tests.helpers import free_port


def test_while_a_failed_push_settles_a_failed_bucket_call_is_named_as_that_call_and_an_exit_comes_first(tmp_path):
    """The push's settle names a server's call that already failed by what it was (here a bucket's /update_weights
    to a URL where nothing answers), not as the rendezvous' join; where the server has also exited (a process killed
    with SIGKILL), its exit is the line (the cause, where the failed call is its effect)."""
    import subprocess
    import sys

    import torch.distributed as dist

    def settle(server: Server) -> str:
        workers = object.__new__(ServerWorkers)  # the trainer's side alone: no server started
        workers.servers, workers.failed, workers.push_timeout_s = [server], False, 5.0
        workers.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        client = ServerSyncClient(workers, workers.store)
        try:
            client.update_weights({"push": 0, "bucket": 3, "entries": [], "nbytes": 0, "weight_version": "1"})
            client.pending[0][1].exception(timeout=10.0)  # refused at once
            with pytest.raises(RolloutWorkerError) as info:
                client.check_alive("the weight push")
        finally:
            client.close()
            del workers.store
        assert "\n" not in str(info.value) and workers.failed
        return str(info.value)

    url = f"http://127.0.0.1:{free_port()}"
    message = settle(Server(0, url))
    assert message.startswith(
        f"trainer: vLLM server 0 at {url} (given by rollout.workers.server_urls; its log is its own) failed the weight "
        "push's bucket 3 (/update_weights): POST /update_weights failed after at most 5 s: "
    ), message
    assert message.endswith("; it does not answer /health either")

    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    killed.wait(timeout=30)
    log_file = tmp_path / "rollout_server0.log"
    message = settle(Server(0, url, process=killed, log_file=log_file))
    assert message == (
        f"trainer: vLLM server 0 at {url} (pid {killed.pid}; see {log_file}) exited with code -9 while the trainer "
        "waited for the weight push"
    )
