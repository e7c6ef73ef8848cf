"""On-policy distillation's teacher on a vLLM server (lit_ppo/training/teacher_server.py, issue 52): its log-probs of
realistic sequences equal the in-process teacher's (against a stand-in server that answers /v1/completions as vLLM
does, with a plain `transformers` forward; slow: against a real vLLM server on CPU), the requests retried and their
failure said in one line, and the pre-flight's checks of the server before any model loads."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lit_ppo.config import ModelConfig, PPOConfig, TeacherConfig
from lit_ppo.errors import ConfigError, TeacherServerError
from lit_ppo.plan import compute_plan
from lit_ppo.rollout.workers.server_http import Server
from lit_ppo.rollout.workers.server_spawn import server_environment
from lit_ppo.testing import synthetic_rollout_batch
from lit_ppo.training.module import PPOModule
from lit_ppo.training.teacher_server import TeacherServer, check_teacher_server
from tests.helpers import FIXTURE_SHAPE, distill_ppo, free_port, mark_interruptible_region, run_config

SAMPLING_TEMPERATURE = 0.7
POSITIONS = 256  # the teacher's: prompts of ~100 tokens and responses of up to 60


@pytest.fixture(scope="module")
def long_teacher_dir(tmp_path_factory) -> str:
    """A teacher of the fixture model's shape and tokenizer with 256 positions (other random weights)."""
    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, max_position_embeddings=POSITIONS, seed=2, **FIXTURE_SHAPE)
    return str(save_model_dir(model, tokenizer, tmp_path_factory.mktemp("long_teacher") / "model"))


@functools.cache
def plain_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.cache
def tokenizer_of(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def prompt_logprobs(model_dir: str, ids: list[int]) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1 at temperature 1, by a plain forward (what vLLM's prompt log-probs are)."""
    with torch.no_grad():
        logits = plain_model(model_dir)(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


class StandIn(http.server.BaseHTTPRequestHandler):
    """vLLM's routes as the teacher's client and check call them: /v1/models, /tokenize, /detokenize and
    /v1/completions with token-id prompts and prompt_logprobs=0 (choices answered in reverse order, each with its
    index). `server.model_dir`: the served model; `server.failures`: statuses to answer /v1/completions with first;
    `server.max_model_len`; `server.tokenize`: the tokenizer of /tokenize; `server.drift`: added to each log-prob once
    per /v1/completions answered before (a server whose answers differ between calls, as vLLM's last bits may)."""

    def do_GET(self):
        if self.path == "/v1/models":
            return self.answer(200, {"data": [{"id": "teacher", "max_model_len": self.server.max_model_len}]})
        self.answer(404, {"detail": "Not Found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append((self.path, body))
        if self.path == "/tokenize":
            tokens = self.server.tokenize(body["prompt"], add_special_tokens=body["add_special_tokens"]).input_ids
            return self.answer(
                200, {"count": len(tokens), "max_model_len": self.server.max_model_len, "tokens": tokens}
            )
        if self.path == "/detokenize":
            if max(body["tokens"]) >= self.server.vocabulary:
                return self.answer(400, {"error": {"message": "Token id out of vocabulary"}})
            return self.answer(200, {"prompt": "x"})
        if self.server.failures:
            failure = self.server.failures.pop(0)
            if failure == "short":  # prompt log-probs of all but the last token
                prompt = [None] + [{str(t): {"logprob": -1.0}} for t in body["prompt"][0][1:-1]]
                return self.answer(200, {"choices": [{"index": 0, "prompt_logprobs": prompt}]})
            return self.answer(failure, {"error": {"message": "stand-in failure"}})
        assert body["prompt_logprobs"] == 0 and body["max_tokens"] == 1 and body["model"] == "teacher"
        answered = next(self.server.answered)  # how many before this one (atomic: requests come in threads)
        choices = []
        for index, ids in enumerate(body["prompt"]):
            scores = [lp + self.server.drift * answered for lp in prompt_logprobs(self.server.model_dir, ids)]
            per_position = [None] + [{str(t): {"logprob": lp, "rank": 1}} for t, lp in zip(ids[1:], scores)]
            choices.append({"index": index, "text": "x", "prompt_logprobs": per_position})
        self.answer(200, {"choices": choices[::-1]})

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def stand_in(long_teacher_dir):
    plain_model(long_teacher_dir)  # loaded here: from_pretrained in the server's threads at once would race
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    server.model_dir, server.failures, server.max_model_len, server.bodies = long_teacher_dir, [], POSITIONS, []
    server.tokenize, server.vocabulary = tokenizer_of(long_teacher_dir), len(tokenizer_of(long_teacher_dir))
    server.drift, server.answered = 0.0, itertools.count()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def realistic_batch():
    """3 prompts of 90-110 tokens, 4 responses each of 30-60 tokens (12 sequences of different lengths)."""
    return synthetic_rollout_batch(3, 4, (90, 110), (30, 60), seed=3, vocab=range(4, 90))


def experience_teacher_logp(model_dir: str, teacher: TeacherConfig, batch) -> torch.Tensor:
    """The experience's teacher log-probs of `batch` (a module on the fixture-shaped student `model_dir`, sampling at
    SAMPLING_TEMPERATURE), padded micro-batches of 4 samples."""
    ppo = distill_ppo(micro_train_batch_size=4, packing=False)
    config = run_config(ppo=ppo, model=ModelConfig(teacher=teacher))
    config = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, temperature=SAMPLING_TEMPERATURE))
    plan = compute_plan(config, 3)
    module = PPOModule(model_dir=model_dir, ppo=ppo, plan=plan, pad_token_id=0, temperature=SAMPLING_TEMPERATURE)
    exp = module.make_experience(batch)
    assert exp.teacher_logp.dtype == torch.float32 and float(exp.mask.sum()) == sum(map(len, batch.response_ids))
    return exp.teacher_logp * exp.mask


def test_a_server_teacher_gives_the_in_process_teachers_logprobs_at_temperature_1(stand_in, long_teacher_dir):
    """Sampling at 0.7 with model.teacher.temperature=1.0: the in-process teacher scores at 1.0 (a plain forward's
    untempered log-probs; at 0.7 they would differ by ~0.1 and more), and the server teacher's experience log-probs (the stand-in's prompt log-probs, sent 16 sequences a
    request, answered out of order) are the in-process teacher's to float32 rounding (measured: max |diff| < 1e-6)."""
    server, url = stand_in
    batch = realistic_batch()
    student = long_teacher_dir  # any model of the tokenizer: only the teacher's log-probs are compared
    in_process = experience_teacher_logp(student, TeacherConfig(path=long_teacher_dir, temperature=1.0), batch)
    for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        expected = torch.tensor(prompt_logprobs(long_teacher_dir, prompt + response)[len(prompt) - 1 :])
        torch.testing.assert_close(in_process[i, : len(response)], expected.float(), rtol=0, atol=2e-5)
    on_server = experience_teacher_logp(student, TeacherConfig(where=url, temperature=1.0), batch)
    difference = float((on_server - in_process).abs().max())
    print(f"server vs in-process teacher log-probs: max |diff| {difference:.2e}")
    torch.testing.assert_close(on_server, in_process, rtol=0, atol=2e-5)
    completions = [body for path, body in server.bodies if path == "/v1/completions"]
    assert sorted(len(body["prompt"]) for body in completions) == [12]  # one request holds the 12 sequences


def test_the_requests_hold_16_sequences_each_and_a_server_error_is_tried_again(stand_in, long_teacher_dir):
    server, url = stand_in
    batch = synthetic_rollout_batch(3, 8, (3, 20), (1, 12), seed=1, vocab=range(4, 90))
    server.failures = [503]  # the first request fails once, then answers
    client = TeacherServer(url, retry_wait_s=0.0)
    rows = client.logprobs(batch.prompt_ids, batch.response_ids)
    for prompt, response, row in zip(batch.prompt_ids, batch.response_ids, rows):
        expected = prompt_logprobs(long_teacher_dir, prompt + response)[len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(row), torch.tensor(expected), rtol=0, atol=2e-5)
    sizes = sorted(len(body["prompt"]) for path, body in server.bodies if path == "/v1/completions")
    assert len(sizes) == 3 and set(sizes) == {8, 16}  # 24 sequences in 2 requests; the failed one sent twice


@pytest.mark.parametrize(
    "failures, words",
    [
        ([400], "(tried once): POST /v1/completions answered HTTP 400"),
        ([500, 502, 503], "(tried 3 times): POST /v1/completions answered HTTP 503"),
        (["short"], "answered the prompt log-probs of 1 sequence (POST /v1/completions) without each sent token's"),
    ],
    ids=["bad-request", "server-errors", "short-answer"],
)
def test_a_failing_server_stops_the_run_in_one_line(stand_in, failures, words):
    server, url = stand_in
    server.failures = list(failures)
    with pytest.raises(TeacherServerError) as error:
        TeacherServer(url, retry_wait_s=0.0).logprobs([[5, 6, 7]], [[8, 9]])
    message = str(error.value)
    assert message.startswith(f"model.teacher.where={url}: the teacher's vLLM server ")
    assert words in message and "; fix: " in message and "\n" not in message


class Hanging(http.server.BaseHTTPRequestHandler):
    """A server that never answers within a test: each request waits 60 s."""

    def do_POST(self):
        time.sleep(60)

    def log_message(self, *args) -> None:
        pass


def test_a_signal_cuts_the_wait_for_a_hanging_teacher_server():
    """The experience pass asks a server teacher inside an interruptible region (lit_ppo.preemption): a SIGTERM cuts
    the wait at once, not after the tries (up to server_teacher_wait_s), and the requests in flight do not hold the
    process's exit (daemon threads)."""
    from lit_ppo.checkpoints import RolloutCheckpoint
    from lit_ppo.preemption import Preemption

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hanging)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = TeacherServer(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=120, retry_wait_s=0.0)
    client._model = "teacher"
    handler = Preemption(RolloutCheckpoint(Path("unused"), every=0, keep=1))
    previous = signal.signal(signal.SIGTERM, handler._on_signal)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        outcome = handler.interruptibly(lambda: client.logprobs([[5, 6, 7]] * 40, [[8, 9]] * 40))
        assert outcome is None and handler.requested == signal.SIGTERM
        assert time.monotonic() - started < 30  # generous: about 0.5 s
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("lit-ppo-teacher"))
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.shutdown()
        server.server_close()


def test_the_experience_pass_asks_a_server_teacher_inside_an_interruptible_region(tiny_model_dir, monkeypatch):
    inside, asked = mark_interruptible_region(monkeypatch), []

    def batch_logprobs(self, prompts, responses, width, device):
        asked.append(inside[0])
        return torch.zeros(len(responses), width)

    monkeypatch.setattr(TeacherServer, "batch_logprobs", batch_logprobs)
    ppo = PPOConfig(rollout_batch_size=2, n_samples_per_prompt=2, train_batch_size=4, micro_train_batch_size=2)
    plan = compute_plan(run_config(ppo=ppo), 8)
    module = PPOModule(model_dir=tiny_model_dir, ppo=ppo, plan=plan, pad_token_id=0)
    module.teacher = TeacherServer("http://127.0.0.1:1")  # never called: its batch_logprobs above answers
    module.make_experience(synthetic_rollout_batch(2, 2, (10, 20), (5, 10)))
    assert asked == [True]


def _context_parallel_teacher_rank(rank: int, url: str, student_dir: str, store: str, results: dict) -> None:
    """One rank of a context-parallel group (C = 2, gloo): the experience of a distillation step with the teacher on
    `url`, the actor's old log-probs through the exchange."""
    from datetime import timedelta

    import torch.distributed as dist

    from lit_ppo.topology import RankTopology

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        ppo = distill_ppo(micro_train_batch_size=4, packing=False)
        config = run_config(ppo=ppo, model=ModelConfig(teacher=TeacherConfig(where=url, temperature=1.0)))
        module = PPOModule(
            model_dir=student_dir, ppo=ppo, plan=compute_plan(config, 3), pad_token_id=0, temperature=0.7
        )
        module.topology = RankTopology(rank=rank, world_size=2, context_parallel_size=2).with_groups()
        exp = module.make_experience(realistic_batch())
        results[rank] = (exp.teacher_logp * exp.mask).tolist()
    except Exception:  # noqa: BLE001 - reported to the test
        import traceback

        results[rank] = traceback.format_exc()
    finally:
        dist.destroy_process_group()


def test_a_context_parallel_group_asks_a_server_teacher_once_and_its_ranks_share_the_answer(
    stand_in, long_teacher_dir, tmp_path
):
    """C = 2 on two gloo ranks, against a server whose answers differ between calls (each log-prob shifted by 0.5 per
    earlier answer): the group's rank 0 alone asks (one request of the 12 sequences), and both ranks take its answer,
    the first one (asked by each rank, the ranks' teacher log-probs, and so their losses, would differ by 0.5)."""
    import torch.multiprocessing as mp

    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir
    from tests.helpers.ranks import start_ranks

    server, url = stand_in
    server.drift = 0.5
    tokenizer = build_char_tokenizer()  # a student whose 4 heads and 2 KV heads divide by C = 2
    shape = dict(FIXTURE_SHAPE, num_heads=4, num_kv_heads=2)
    student = build_tiny_model(tokenizer, **shape, max_position_embeddings=POSITIONS, seed=0)
    student_dir = str(save_model_dir(student, tokenizer, tmp_path / "student"))
    results = mp.Manager().dict()
    start_ranks(_context_parallel_teacher_rank, 2, url, student_dir, str(tmp_path / "store"), results)
    teacher_logp = [results[rank] for rank in range(2)]
    assert all(isinstance(t, list) for t in teacher_logp), teacher_logp
    assert teacher_logp[0] == teacher_logp[1]  # bitwise the same on the group's two ranks
    assert [len(body["prompt"]) for path, body in server.bodies if path == "/v1/completions"] == [12]
    batch = realistic_batch()
    for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        expected = torch.tensor(prompt_logprobs(long_teacher_dir, prompt + response)[len(prompt) - 1 :])
        torch.testing.assert_close(
            torch.tensor(teacher_logp[1][i][: len(response)]), expected.float(), rtol=0, atol=2e-5
        )


def test_nothing_listening_is_tried_three_times_then_said_in_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TeacherServerError, match=r"GET /v1/models \(tried 3 times\).*ConnectionRefusedError") as e:
        TeacherServer(url, retry_wait_s=0.0).logprobs([[5, 6]], [[7]])
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ the pre-flight


def test_the_preflight_checks_the_servers_tokenizer_vocabulary_and_length(stand_in, long_teacher_dir):
    server, url = stand_in
    student = tokenizer_of(long_teacher_dir)
    check_teacher_server(url, student, "the student", longest_sequence=POSITIONS - 1)  # all fits
    probes = [body["prompt"] for path, body in server.bodies if path == "/tokenize"]
    assert len(probes) == 4 and "<|endoftext|>" in probes[-1]  # three texts and the student's special tokens

    def refused(words: str, **check) -> None:
        with pytest.raises(ConfigError) as error:
            check_teacher_server(url, student, "the student", **{"longest_sequence": 100, **check})
        message = str(error.value)
        assert message.startswith(f"model.teacher.where={url}: the teacher's vLLM server") and "\n" not in message
        assert words in message, message

    refused("has max_model_len=256, below the longest sequence it scores", longest_sequence=POSITIONS)
    server.vocabulary = 50
    refused(f"its vocabulary has no token id {len(student) - 1}, the student's last")
    server.vocabulary = len(student)
    server.tokenize = lambda text, add_special_tokens: student(text[::-1], add_special_tokens=add_special_tokens)
    refused("its tokenizer is not the student's (the student): 'The quick brown fox")
    with pytest.raises(ConfigError, match=r"does not answer /v1/models \(nothing listens there\); fix: start it"):
        check_teacher_server(f"http://127.0.0.1:{free_port()}", student, "s", longest_sequence=10)


def test_a_server_teacher_is_checked_before_any_model_loads_and_has_no_trainer_memory(
    stand_in, long_teacher_dir, tmp_path, monkeypatch
):
    """`preflight` of a ppo=distill run with model.teacher.where=<url>: the server's tokenizer is compared (its
    /tokenize called) without loading a model; the plan names the server and the memory estimate has no teacher row."""
    import transformers

    from lit_ppo.run.entry import compose_run_config
    from lit_ppo.run.prepare import preflight
    from lit_ppo.run.report import memory_estimate

    server, url = stand_in

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the teacher's server was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    overrides = ("ppo=distill", f"model.teacher.where={url}", "model.teacher.temperature=1.0")
    config = compose_run_config(*overrides, "model.warm_start.enabled=false")
    preflight(config, tmp_path / "run")
    assert any(path == "/tokenize" for path, _ in server.bodies)
    server.tokenize = lambda text, add_special_tokens: tokenizer_of(long_teacher_dir)(text[:-1])
    with pytest.raises(ConfigError, match="its tokenizer is not the student's"):
        preflight(config, tmp_path / "run")
    plan = compute_plan(config, 1000)
    table = plan.table()
    assert url in table and "on a vLLM server" in table and "teacher forwards" not in table
    assert "scored at temperature 1" in table
    rows = [what for what, _, _ in memory_estimate(config, plan).rows]
    assert "teacher weights" not in rows and "weights" in rows


# ------------------------------------------------------------------ a real vLLM server


def start_teacher_server(model_dir: str, log_file: Path) -> tuple[subprocess.Popen, str]:
    """`vllm serve` of the teacher as a user starts it (float32, its defaults otherwise: prefix caching and chunked
    prefill on), on CPU; its URL once it answers /health."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", str(POSITIONS), "--enforce-eager", "--seed", "0"]
    with open(log_file, "wb") as out:
        process = subprocess.Popen(
            command,
            env=server_environment(kv_cache_gib=1),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while not Server(0, url).healthy():
        assert process.poll() is None and time.monotonic() < deadline, log_file.read_text()[-3000:]
        time.sleep(1.0)
    return process, url


@pytest.mark.slow  # a vLLM server's start on CPU (a minute or more on 2 busy cores)
def test_a_real_vllm_server_teacher_gives_the_in_process_teachers_logprobs(long_teacher_dir, tmp_path):
    """A teacher served by vLLM (CPU, float32) passes the pre-flight (its tokenizer is the student's, its max_model_len
    holds the sequences) and its experience log-probs of 12 sequences (prompts of 90-110 tokens, responses of 30-60,
    sampled at 0.7, scored at model.teacher.temperature=1.0) are the in-process teacher's to float32 rounding."""
    process, url = start_teacher_server(long_teacher_dir, tmp_path / "teacher_server.log")
    try:
        check_teacher_server(url, tokenizer_of(long_teacher_dir), "the student", longest_sequence=POSITIONS - 1)
        batch = realistic_batch()
        in_process = experience_teacher_logp(
            long_teacher_dir, TeacherConfig(path=long_teacher_dir, temperature=1.0), batch
        )
        on_server = experience_teacher_logp(long_teacher_dir, TeacherConfig(where=url, temperature=1.0), batch)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    difference = float((on_server - in_process).abs().max())
    print(f"vLLM server vs in-process teacher log-probs: max |diff| {difference:.2e}")
    torch.testing.assert_close(on_server, in_process, rtol=0, atol=2e-5)  # measured: 4.8e-07
