"""The trainer's HTTP calls to vLLM servers (lit_ppo/rollout/workers/server_http.py), against a stand-in HTTP server:
what a failed call says (its route, the status or the reason, whether nothing listens), and the one line that names
the server when a call of the run fails."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest

from lit_ppo.errors import RolloutWorkerError
from lit_ppo.rollout.workers.server_http import HTTPFailure, Server, ServerCalls
from tests.helpers import free_port


class Routes(http.server.BaseHTTPRequestHandler):
    """/health and /ok answer JSON, /text answers what is not JSON, any other route HTTP 404 with a body."""

    def do_GET(self):
        if self.path in ("/health", "/ok"):
            self.answer(200, json.dumps({"route": self.path}).encode())
        elif self.path == "/text":
            self.answer(200, b"<html>no</html>")
        else:
            self.answer(404, b'{"detail":"Not Found"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.answer(200, json.dumps({"got": body}).encode())

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_call_answers_json_and_a_failed_one_says_its_route_and_status_or_that_nothing_listens(url):
    server = Server(0, url)
    assert server.call("GET", "/ok") == {"route": "/ok"}
    assert server.post("/echo", {"a": 1}) == {"got": {"a": 1}} and server.post("/echo") == {"got": {}}
    assert server.healthy() and server.health_failure() is None and server.exit_code() is None
    with pytest.raises(HTTPFailure) as info:
        server.call("GET", "/missing")
    assert (str(info.value), info.value.status, info.value.refused) == (
        'GET /missing answered HTTP 404: {"detail":"Not Found"}',
        404,
        False,
    )
    with pytest.raises(HTTPFailure, match=r"^GET /text answered what is not JSON: '<html>no</html>'$"):
        server.call("GET", "/text")
    nobody = Server(1, f"http://127.0.0.1:{free_port()}")
    failure = nobody.health_failure()
    assert failure is not None and failure.refused and failure.status is None
    assert str(failure).startswith("GET /health failed after at most 5 s: ConnectionRefusedError(")


class Calls(ServerCalls):
    def __init__(self, servers):
        self.servers, self.failed = servers, False


def test_a_failed_call_of_the_run_names_the_server_and_whether_it_answers_health_or_exited(url):
    calls = Calls([Server(0, url)])
    assert calls.call(calls.servers[0], "/ok", "a route", 5.0, method="GET") == {"route": "/ok"}
    assert not calls.failed
    with pytest.raises(RolloutWorkerError) as info:
        calls.call(calls.servers[0], "/missing", "the missing route", 5.0, method="GET")
    assert str(info.value) == (
        f"trainer: vLLM server 0 at {url} (given by rollout.workers.server_urls; its log is its own) failed the "
        'missing route: GET /missing answered HTTP 404: {"detail":"Not Found"}'
    )
    assert calls.failed
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RolloutWorkerError, match=r"failed the join: POST /join .*; it does not answer /health either$"):
        Calls([Server(0, gone)]).call(Server(0, gone), "/join", "the join", 5.0)
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    exited.wait(timeout=30)
    dead = Server(2, gone, process=exited, log_file="server2.log")
    with pytest.raises(RolloutWorkerError) as info:
        Calls([dead]).call(dead, "/join", "the join", 5.0)
    assert str(info.value) == (
        f"trainer: vLLM server 2 at {gone} (pid {exited.pid}; see server2.log) exited with code 3 while the trainer "
        "waited for the join"
    )
