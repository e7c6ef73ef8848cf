"""The trainer's HTTP calls to vLLM servers as rollout workers (rollout.workers.launch=server, docs/async.md): one
server (`Server`: its URL and, spawned, its process and log) and the calls to the run's servers that stop the run in
one line naming the server on failure (`ServerCalls`: an HTTP error or timeout, or a server that stopped answering
/health or exited), which the client (`servers`) and the push (`server_push`) share."""

from __future__ import annotations

import logging
import subprocess
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

from lit_ppo.errors import RolloutWorkerError
from lit_ppo.http_json import HTTPFailure, call_json

__all__ = ["HTTPFailure", "Server", "ServerCalls", "SERVED_MODEL_NAME", "HEALTH_TIMEOUT_S"]

log = logging.getLogger("lit_ppo")

SERVED_MODEL_NAME = "policy"
"""--served-model-name of a spawned server (a given server's name is read from its /v1/models)."""
HEALTH_TIMEOUT_S = 5.0  # one /health call


@dataclass
class Server:
    """One server: its URL and, when the trainer spawned it, its process and log."""

    number: int
    url: str
    process: subprocess.Popen | None = None
    log_file: Path | None = None
    model: str = SERVED_MODEL_NAME

    def describe(self) -> str:
        if self.process is None:
            return f"vLLM server {self.number} at {self.url} (given by rollout.workers.server_urls; its log is its own)"
        return f"vLLM server {self.number} at {self.url} (pid {self.process.pid}; see {self.log_file})"

    def call(self, method: str, path: str, body: dict | None = None, timeout_s: float = 60.0) -> dict:
        return call_json(self.url, method, path, body, timeout_s)

    def post(self, path: str, body: dict | None = None, timeout_s: float = 60.0) -> dict:
        return self.call("POST", path, body if body is not None else {}, timeout_s)

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def healthy(self) -> bool:
        return self.health_failure() is None

    def health_failure(self) -> HTTPFailure | None:
        """Why /health does not answer (None: it does)."""
        try:
            self.call("GET", "/health", timeout_s=HEALTH_TIMEOUT_S)
            return None
        except HTTPFailure as e:
            return e


class ServerCalls:
    """The run's servers and its calls to them: each failure stops the run in one line naming the server (its exit
    where it exited, else the call and the reason, and whether it still answers /health); `failed` says a call
    failed (`close` then stops spawned servers at once and lets given ones resume)."""

    servers: list[Server]
    failed: bool
    start_timeout_s: float
    batch_timeout_s: float
    push_timeout_s: float

    def check_running(self, server: Server, what: str) -> None:
        code = server.exit_code()
        if code is not None:
            self.failed = True
            raise RolloutWorkerError(
                f"trainer: {server.describe()} exited with code {code} while the trainer waited for {what}"
            )

    def call(
        self, server: Server, path: str, what: str, timeout_s: float, body: dict | None = None, method: str = "POST"
    ) -> dict:
        """One route of `server`, or RolloutWorkerError in one line naming it."""
        try:
            return server.call(method, path, (body or {}) if method == "POST" else None, timeout_s)
        except HTTPFailure as e:
            self._failure(server, what, e)

    def result(self, server: Server, future: Future, what: str, timeout_s: float):
        """A pending call's answer within `timeout_s`, or RolloutWorkerError in one line naming the server."""
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            self._failure(server, what, f"no answer within {timeout_s:g} s")
        except HTTPFailure as e:
            self._failure(server, what, e)

    def _failure(self, server: Server, what: str, reason) -> None:
        self.failed = True
        self.check_running(server, what)  # an exited server is the better message
        health = "" if server.healthy() else "; it does not answer /health either"
        raise RolloutWorkerError(f"trainer: {server.describe()} failed {what}: {reason}{health}")

    def cleanup_warning(self, message: str, *args) -> None:
        """A warning of `close` about a given server: on the console, except after a failure, whose own line (printed
        after `close`) names the server: there run.log only."""
        log.warning(message, *args, extra={"console": False} if self.failed else None)
