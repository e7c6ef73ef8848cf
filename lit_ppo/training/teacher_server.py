"""On-policy distillation's teacher on a vLLM server (`model.teacher.where=http://host:port`): its log-probs of the
sampled tokens are the server's prompt log-probs of each sequence (prompt + response, sent as token ids to the
OpenAI-compatible /v1/completions with `prompt_logprobs=0`, `max_tokens=1`), several sequences per request and several
requests at once, each retried before the run stops in one line (`TeacherServer`); and the pre-flight's check of the
server before any model loads (`check_teacher_server`): it answers, its tokenizer reads ids as the student's does, and
its max_model_len holds the longest sequence.

vLLM's prompt log-probs are of the untempered distribution (the sampler's temperature is not applied to the prompt):
a server teacher scores at temperature 1 (`config.distill.check_teacher_sampling` refuses any other)."""

from __future__ import annotations

import threading
import time

import torch
from torch import Tensor

# A request's tries, waits and timeout: their total (`server_teacher_wait_s`) is checked against
# trainer.collective_timeout_s under data parallelism (config/distill.py).
from lit_ppo.config.distill import SERVER_REQUEST_TIMEOUT_S as REQUEST_TIMEOUT_S
from lit_ppo.config.distill import SERVER_RETRY_WAIT_S as RETRY_WAIT_S
from lit_ppo.config.distill import SERVER_TRIES as TRIES
from lit_ppo.errors import ConfigError, TeacherServerError
from lit_ppo.http_json import HTTPFailure, call_json

SEQUENCES_PER_REQUEST = 16  # sequences of one /v1/completions request (its `prompt`: a list of token-id lists)
REQUESTS_IN_FLIGHT = 4  # requests sent at once
CHECK_TIMEOUT_S = 30.0  # one call of the pre-flight's check
PROBES = (
    "The quick brown fox jumps over the lazy dog.",
    "  12 + 345 = 357\n\tx_1 = (a*b) / 7; print('ok')",
    "Ünïcödé: café, naïve, 東京, emoji 🙂",
)  # texts tokenized by the server and by the student's tokenizer (with the student's special tokens appended)


class TeacherServer:
    """The client of the teacher's server: `logprobs(prompts, responses)` and, for the experience, `batch_logprobs`."""

    def __init__(self, url: str, timeout_s: float = REQUEST_TIMEOUT_S, retry_wait_s: float = RETRY_WAIT_S):
        self.url, self.timeout_s, self.retry_wait_s = url.rstrip("/"), timeout_s, retry_wait_s
        self._model: str | None = None

    def describe(self) -> str:
        return f"model.teacher.where={self.url}: the teacher's vLLM server"

    @property
    def model(self) -> str:
        """The served model's name (its /v1/models), read once."""
        if self._model is None:
            self._model = served_model(self.call("GET", "/v1/models", "GET /v1/models", CHECK_TIMEOUT_S))["id"]
        return self._model

    def call(self, method: str, path: str, what: str, timeout_s: float, body: dict | None = None) -> dict:
        """One call, tried TRIES times where the server did not answer or answered with its own error (5xx); else
        TeacherServerError in one line naming the server, the call and the reason."""
        for attempt in range(TRIES):
            try:
                return call_json(self.url, method, path, body, timeout_s)
            except HTTPFailure as e:
                failure = e
                if e.status is not None and e.status < 500:  # the request itself is wrong: another try is the same
                    break
                if attempt + 1 < TRIES:
                    time.sleep(self.retry_wait_s * 2**attempt)
        tries = "once" if failure.status is not None and failure.status < 500 else f"{TRIES} times"
        raise TeacherServerError(
            f"{self.describe()} failed {what} (tried {tries}): {failure}; fix: check that the server runs and serves "
            "the teacher (its /health, its log), or model.teacher.where=trainer"
        )

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """Per sequence, the teacher's log-prob of each response token given everything before it (untempered)."""
        chunks = [
            list(range(start, min(start + SEQUENCES_PER_REQUEST, len(prompts))))
            for start in range(0, len(prompts), SEQUENCES_PER_REQUEST)
        ]

        def score(chunk: list[int]) -> list[list[float]]:
            sequences = [list(prompts[i]) + list(responses[i]) for i in chunk]
            body = dict(model=self.model, prompt=sequences, max_tokens=1, temperature=0.0, prompt_logprobs=0)
            what = (
                f"the prompt log-probs of {len(chunk)} sequence{'s' if len(chunk) > 1 else ''} (POST /v1/completions)"
            )
            answer = self.call("POST", "/v1/completions", what, self.timeout_s, body)
            try:
                choices = sorted(answer["choices"], key=lambda c: c["index"])
                assert len(choices) == len(chunk)
                return [
                    [choice["prompt_logprobs"][j][str(ids[j])]["logprob"] for j in range(len(prompts[i]), len(ids))]
                    for i, ids, choice in zip(chunk, sequences, choices)
                ]
            except (KeyError, IndexError, TypeError, AssertionError) as e:  # not vLLM's answer to this request
                raise TeacherServerError(
                    f"{self.describe()} answered {what} without each sent token's log-prob ({type(e).__name__}: "
                    f"{e}); fix: serve the teacher with vLLM's OpenAI-compatible server (vllm serve)"
                ) from None

        return [row for rows in in_daemon_threads(score, chunks, REQUESTS_IN_FLIGHT) for row in rows]

    def batch_logprobs(self, prompts: list[list[int]], responses: list[list[int]], width: int, device) -> Tensor:
        """The experience's teacher log-probs: [N, width] float32, the response tokens' from the left, zero after."""
        out = torch.zeros(len(responses), width, dtype=torch.float32)
        for i, row in enumerate(self.logprobs(prompts, responses)):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        return out.to(device)


def in_daemon_threads(fn, items: list, workers: int) -> list:
    """fn(item) for each item, `workers` at a time, in daemon threads: their results in order, or the first failure
    raised. The caller's wait (a join) is cut by a signal inside an interruptible region (lit_ppo.preemption), and a
    request still in flight then does not hold the process's exit (a ThreadPoolExecutor's threads would)."""
    results: list = [None] * len(items)
    failures: list[BaseException] = []
    pending = iter(enumerate(items))
    lock = threading.Lock()

    def work() -> None:
        while not failures:
            with lock:
                task = next(pending, None)
            if task is None:
                return
            try:
                results[task[0]] = fn(task[1])
            except BaseException as e:  # handed to the caller's thread
                failures.append(e)

    threads = [threading.Thread(target=work, daemon=True, name="lit-ppo-teacher") for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return results


def served_model(answer: dict) -> dict:
    """The one model of a /v1/models answer."""
    return answer["data"][0]


def check_teacher_server(url: str, student_tokenizer, student_name: str, longest_sequence: int | None) -> None:
    """Before any model loads: the server answers /v1/models, tokenizes the probe texts (and the student's special
    tokens) into the student's ids, knows the student's last token id, and its max_model_len holds the longest
    sequence the teacher scores (+1: vLLM generates one token after the prompt). Each failure one line."""
    server = TeacherServer(url)

    def call(path: str, body: dict | None = None) -> dict:
        try:
            return call_json(server.url, "POST" if body is not None else "GET", path, body, CHECK_TIMEOUT_S)
        except HTTPFailure as e:
            where = "nothing listens there" if e.refused else str(e)
            raise ConfigError(
                f"{server.describe()} does not answer {path} ({where}); fix: start it (vllm serve <teacher> --port "
                "<port>) and wait for its /health, or correct model.teacher.where"
            ) from None

    model = served_model(call("/v1/models"))
    specials = "".join(str(t) for t in student_tokenizer.all_special_tokens)
    for text in (*PROBES, specials):
        theirs = call("/tokenize", dict(model=model["id"], prompt=text, add_special_tokens=False))["tokens"]
        ours = student_tokenizer(text, add_special_tokens=False).input_ids
        if theirs != ours:
            raise ConfigError(
                f"{server.describe()}: its tokenizer is not the student's ({student_name}): {text!r} is {theirs} "
                f"there and {ours} here; the teacher scores the student's token ids, so both must read them alike; "
                "fix: serve a teacher of the student's tokenizer (the same model family)"
            )
    last = len(student_tokenizer) - 1
    try:
        call_json(server.url, "POST", "/detokenize", dict(model=model["id"], tokens=[last]), CHECK_TIMEOUT_S)
    except HTTPFailure as e:
        raise ConfigError(
            f"{server.describe()}: its vocabulary has no token id {last}, the student's last ({e}); fix: serve a "
            "teacher of the student's tokenizer (the same model family)"
        ) from None
    needed = None if longest_sequence is None else longest_sequence + 1
    if needed is not None and model.get("max_model_len") is not None and model["max_model_len"] < needed:
        raise ConfigError(
            f"{server.describe()} has max_model_len={model['max_model_len']}, below the longest sequence it scores "
            f"({longest_sequence} prompt and response tokens, +1 it generates); fix: restart it with --max-model-len "
            f"{needed} or more"
        )
