"""One JSON call over HTTP to a vLLM server (`call_json`) and its failure in words (`HTTPFailure`): shared by the
rollout workers' servers (lit_ppo/rollout/workers/server_http.py) and the distillation teacher's server
(lit_ppo/training/teacher_server.py), which each name the server and the fix in their own one line."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request


class HTTPFailure(RuntimeError):
    """An HTTP call that failed: its route and the reason, for the one line that names the server; `status`: the HTTP
    status it was answered with, if any; `refused`: nothing listens at the address (connection refused)."""

    def __init__(self, message: str, status: int | None = None, refused: bool = False):
        super().__init__(message)
        self.status, self.refused = status, refused


def call_json(url: str, method: str, path: str, body: dict | None = None, timeout_s: float = 60.0) -> dict:
    """`method` `url + path` with `body` as JSON; the answer's JSON ({} when empty), or HTTPFailure."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").replace("\n", " ")[:300]
        raise HTTPFailure(f"{method} {path} answered HTTP {e.code}: {detail}", status=e.code) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, cut, timed out
        reason = getattr(e, "reason", e)
        refused = isinstance(reason, ConnectionRefusedError)
        raise HTTPFailure(
            f"{method} {path} failed after at most {timeout_s:g} s: {reason!r}", refused=refused
        ) from None
    try:
        return json.loads(text) if text else {}
    except ValueError:
        raise HTTPFailure(f"{method} {path} answered what is not JSON: {text[:200]!r}") from None
