"""The weight push to vLLM servers as rollout workers (rollout.workers.launch=server, docs/async.md).

lit-ppo's `lit_ppo_gloo` backend (`weight_transfer`) is registered in the server's processes by a vLLM general plugin
(the entry point `lit_ppo_gloo` in pyproject.toml; a spawned server also gets it from a `*.dist-info` folder on its
PYTHONPATH where the installed lit-ppo does not declare it, `server_spawn.plugin_path`). The trainer's
`GlooTrainerWeightTransferEngine` drives it through `ServerSyncClient`, which calls the server's routes
(/init_weight_transfer_engine, /start_weight_update, /update_weights per bucket while the bucket is broadcast,
/finish_weight_update with the version). `ServerPush.push` pauses the servers (/pause?mode=wait), pushes, resumes them
and checks each push: the server's teacher-forced log-probs of the trainer's probe sequence (`prompt_logprobs` of
/v1/completions) against the trainer's, within rollout.max_logprob_abs_diff, and its /weight_info version. That every
request sent before the push has finished is the client's to wait for (`servers.ServerWorkers.update_weights`).
"""

from __future__ import annotations

import functools
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor

from lit_ppo.contract import WeightUpdate
from lit_ppo.errors import RolloutWorkerError
from lit_ppo.rollout.weight_transfer.transport import PushAnnouncer, host_store, probe_mismatch
from lit_ppo.rollout.workers.server_http import HTTPFailure, Server, ServerCalls

SETTLE_S = 2.0  # after a failed broadcast: how long a killed server may take to be seen exited


class ServerSyncClient:
    """vLLM's `VLLMWeightSyncClient` for the trainer's `GlooTrainerWeightTransferEngine`, over the servers' HTTP
    routes. The servers' receivers (`StagedReceiver`) wait for each bucket's info in the trainer's store as spawned
    workers' do; each bucket's /update_weights is sent while the trainer broadcasts it (it returns once the server
    received and loaded it), in order, from one thread per server."""

    def __init__(self, workers: ServerCalls, store):
        self.workers = workers
        self.announcer = PushAnnouncer(store)
        self.pending: list[tuple[Server, Future, str]] = []  # calls sent, not yet awaited: server, answer, what
        self.senders = [ThreadPoolExecutor(1, thread_name_prefix=f"lit-ppo-push{s.number}") for s in workers.servers]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Each server joins the gloo group as rank 1 + its number (its rank_offset: tensor parallelism is refused;
        the call returns once the trainer joined too, so it is sent from the server's thread and awaited in
        `joined`)."""
        for server, sender in zip(self.workers.servers, self.senders):
            own_host = urllib.parse.urlsplit(server.url).hostname or init_info["host"]
            info = {**init_info, "rank_offset": server.number + 1, "own_host": own_host}
            what = "joining the weight push's gloo group"
            self._send(server, sender, "/init_weight_transfer_engine", {"init_info": info}, what)

    def check_alive(self, what: str = "the weight push's rendezvous") -> None:
        """Between the rendezvous' polls, and while a failed push settles: a server that exited, or whose call
        already failed (its join, a bucket's /update_weights), is named at once with the call, not after the group's
        timeout."""
        for server in self.workers.servers:
            self.workers.check_running(server, what)
        for server, future, call in self.pending:
            if future.done() and future.exception() is not None:
                self.workers.result(server, future, call, 0.0)

    def joined(self) -> None:
        self._await(self.workers.start_timeout_s)

    def start_weight_update(self) -> None:
        for server in self.workers.servers:
            self.workers.call(server, "/start_weight_update", "the weight push's start", self.workers.push_timeout_s)

    def update_weights(self, update_info: dict) -> None:
        self.announcer.bucket(update_info)
        what = f"the weight push's bucket {update_info['bucket']} (/update_weights)"
        for server, sender in zip(self.workers.servers, self.senders):
            self._send(server, sender, "/update_weights", {"update_info": update_info}, what)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.announcer.end()
        self._await(self.workers.push_timeout_s)
        for server in self.workers.servers:
            self.workers.call(
                server,
                "/finish_weight_update",
                "the weight push's end",
                self.workers.push_timeout_s,
                {"weight_version": weight_version},
            )

    def _send(self, server: Server, sender: ThreadPoolExecutor, path: str, body: dict, what: str) -> None:
        """`path` sent from the server's thread; `what` names the call in the line that reports its failure."""
        timeout_s = self.workers.push_timeout_s
        self.pending.append((server, sender.submit(server.post, path, body, timeout_s), what))

    def _await(self, timeout_s: float) -> None:
        pending, self.pending = self.pending, []
        for server, future, what in pending:
            self.workers.result(server, future, what, timeout_s)

    def close(self) -> None:
        for sender in self.senders:
            sender.shutdown(wait=False, cancel_futures=True)


class ServerPush:
    """The trainer's side of the push to `calls.servers`: the store of the gloo group's rendezvous (which the servers'
    receivers also poll for each bucket's info), the trainer's weight-transfer engine and its `ServerSyncClient`."""

    def __init__(self, calls: ServerCalls, max_logprob_abs_diff: float | None):
        self.calls, self.max_logprob_abs_diff = calls, max_logprob_abs_diff
        self.store = self.transfer = self.sync_client = None

    def start(self, host: str, bucket_mib: int) -> None:
        """The gloo group's rendezvous with every server (each joins as rank 1 + its number)."""
        from lit_ppo.rollout.weight_transfer.backend import start_trainer_transfer

        calls = self.calls
        self.store = host_store(host, 0, calls.start_timeout_s)
        self.sync_client = ServerSyncClient(calls, self.store)
        self.transfer = start_trainer_transfer(
            host=host,
            port=self.store.port,
            world_size=len(calls.servers) + 1,
            bucket_bytes=bucket_mib * 2**20,
            timeout_s=calls.push_timeout_s,
            client=self.sync_client,
        )
        self.sync_client.joined()

    def push(self, update: WeightUpdate) -> int:
        """/pause?mode=wait (nothing of another client's is cut), the push of `update`'s full weights through the
        trainer's weight-transfer engine, /resume, and the checks: each server reports the version (/weight_info) and
        its log-probs of the update's probe equal the trainer's. Returns the bytes pushed."""
        from lit_ppo.rollout.weight_transfer.backend import BucketBroadcastError, ParamMeta, TensorSource

        calls, version = self.calls, update.policy_version
        for server in calls.servers:
            calls.call(server, "/pause?mode=wait", "/pause before a push", calls.batch_timeout_s)
        source = TensorSource(update.tensors, [ParamMeta(*m) for m in update.metadata])
        try:
            self.transfer.send_weights(source, weight_version=str(version))
        except BucketBroadcastError as e:
            calls.failed = True
            # A killed server closes its sockets moments before it is seen to exit, and a server whose receiver
            # failed answers its /update_weights with the reason: either is the better message.
            deadline = time.monotonic() + SETTLE_S
            while time.monotonic() < deadline:
                self.sync_client.check_alive("the weight push")
                time.sleep(0.05)
            raise RolloutWorkerError(
                f"trainer: the weight push of version {version} (bucket {e.bucket}, {e.nbytes / 2**20:.1f} MiB) did "
                f"not complete within rollout.workers.weight_push_timeout_s={calls.push_timeout_s:g} s ({e.seconds:.1f} "
                f"s, {e.cause_name}); a server is stuck: {', '.join(s.describe() for s in calls.servers)}"
            ) from None
        for server in calls.servers:
            calls.call(server, "/resume", "/resume after a push", calls.batch_timeout_s)
        probe = update.probe() if update.probe is not None else None
        for server in calls.servers:
            self._check_push(server, version, probe)
        return source.bytes

    def _check_push(self, server: Server, version: int, probe) -> None:
        """The server holds `version` (its /weight_info) and its log-probs of the probe sequence are the trainer's
        (mean absolute difference per token within rollout.max_logprob_abs_diff, as spawned workers check)."""
        held = self.calls.call(server, "/weight_info", "/weight_info", 30.0, method="GET")["weight_version"]
        if held != str(version):
            self.calls.failed = True
            raise RolloutWorkerError(
                f"trainer: {server.describe()} reports weight version {held!r} after the push of version {version} "
                "(it did not commit the version, or another client pushed to it); fix: give each run servers of its own"
            )
        sequence_logprobs = functools.partial(self._sequence_logprobs, server)
        where = f"trainer: {server.describe()}: after the push of policy version {version}"
        mismatch = probe_mismatch(probe, self.max_logprob_abs_diff, sequence_logprobs, where)
        if mismatch is not None:
            self.calls.failed = True
            raise RolloutWorkerError(mismatch)

    def _sequence_logprobs(self, server: Server, prompt: list[int], response: list[int]) -> list[float]:
        """The server's teacher-forced log-probs of each response token (/v1/completions' `prompt_logprobs`)."""
        ids = list(prompt) + list(response)
        body = dict(model=server.model, prompt=ids, max_tokens=1, temperature=0.0, prompt_logprobs=0)
        per_position = self.calls.call(
            server, "/v1/completions", "the probe after a push", self.calls.batch_timeout_s, body
        )
        per_position = per_position["choices"][0]["prompt_logprobs"]
        return [per_position[j][str(ids[j])]["logprob"] for j in range(len(prompt), len(ids))]

    def close(self) -> None:
        """The sync client's threads stopped; given servers' weight-transfer engines shut down (spawned ones are
        stopped), then the trainer's."""
        if self.sync_client is not None:
            self.sync_client.close()
        for server in self.calls.servers:
            if server.process is None and self.transfer is not None:
                try:
                    server.post("/shutdown_weight_transfer_engine", timeout_s=10.0)
                except HTTPFailure as e:
                    self.calls.cleanup_warning(
                        "trainer: %s: shutting its weight transfer down failed: %s", server.describe(), e
                    )
        if self.transfer is not None:
            self.transfer.shutdown()
        self.transfer = self.store = None
