"""Reward functions and the code that calls them safely.

A reward function has this signature (the `reward.fn` config entry names one by dotted path,
with `_partial_: true` so extra keyword arguments can be bound in the YAML):

    def my_reward(prompts: list[str], responses: list[str], references: list[str | None],
                  extras: list[dict]) -> list[float] | tuple[list[float], dict[str, list[float]]]

`prompts` are the prompts as the model saw them (after any chat template), `references` the
reference answers (`data.answer_key`, None without one) and `extras` the `data.extra_keys` fields of
each sample's record. It returns one finite float per response, and optionally extra per-sample
metrics that are logged as `rollout/reward_<name>` means. A callable object works too (see
`SequenceClassifierReward`): leave out `_partial_` and Hydra builds it once from its arguments.

Reward functions written for TRL, verl or OpenRLHF are called as those frameworks call them
(`reward.signature`, `auto` by default: told apart by their parameter names; see `RewardCall`).
With `reward.workers > 0` each sample is scored in a worker process under `reward.timeout_s`
(`RewardWorkers`): a verifier that hangs or kills its process costs that sample, not the run. With the default
`reward.workers=0` each call of the function in this process is cut after `reward.timeout_s` (`call_with_deadline`):
a batch call that runs past it is scored again one sample at a time under the same limit, so the slow samples are
found and count as timeouts; that is serial, so for a verifier that often hangs use workers.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import multiprocessing
import numbers
import pickle
import re
import signal
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from lit_ppo.algorithms import overlong_penalty
from lit_ppo.config import RunConfig
from lit_ppo.errors import ConfigError

log = logging.getLogger("lit_ppo")

_INTEGER = re.compile(r"-?\d+")
ON_ERROR = ("raise", "zero")
SIGNATURES = ("auto", "lit_ppo", "trl", "verl", "openrlhf")
# The parameter that only one convention names: how `auto` tells them apart.
SIGNATURE_MARKERS = {"lit_ppo": "responses", "trl": "completions", "verl": "solution_str", "openrlhf": "queries"}


def integer_match(prompts, responses, references, extras, **_) -> list[float]:
    """1.0 when the response is exactly the reference integer (surrounding spaces allowed), else 0.0."""
    scores = []
    for response, reference in zip(responses, references):
        text = response.strip()
        scores.append(
            1.0 if _INTEGER.fullmatch(text) and reference is not None and int(text) == int(reference) else 0.0
        )
    return scores


class SequenceClassifierReward:
    """A local reward model: a `transformers` sequence-classification model directory scoring prompt + response.

    The score of a sample is the logit `score_index` at the last token of prompt + response; batches
    of `batch_size` texts, kept to their last `max_length` tokens when that is set."""

    def __init__(
        self,
        model_dir: str,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        score_index: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not (Path(model_dir) / "config.json").exists():
            raise ConfigError(
                f"reward.fn.model_dir={model_dir} is not a model directory (no config.json); "
                "fix: point it at a saved AutoModelForSequenceClassification"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.truncation_side = "left"  # the response, at the end, is what is being judged
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # finds each text's last token in a padded batch
        self.model.to(device).eval()
        if not 0 <= score_index < self.model.config.num_labels:
            raise ConfigError(
                f"reward.fn.score_index={score_index} but the model has {self.model.config.num_labels} labels; "
                f"fix: use 0..{self.model.config.num_labels - 1}"
            )
        self.batch_size, self.max_length, self.score_index, self.device = batch_size, max_length, score_index, device

    def __call__(self, prompts, responses, references, extras) -> list[float]:
        import torch

        texts = [p + r for p, r in zip(prompts, responses)]
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=self.max_length is not None,
                    max_length=self.max_length,
                ).to(self.device)
                logits = self.model(**batch).logits  # [B, num_labels]
                scores.extend(logits[:, self.score_index].float().tolist())
        return scores


# Reward metrics that count samples (the others are per-sample means): summed over data-parallel ranks, not averaged.
COUNT_METRICS = ("errors", "timeouts", "none")


from lit_ppo.errors import RewardError  # noqa: E402,F401 - defined with every user error; importable from here too


def _parameters(fn) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)  # a functools.partial's bound keywords stay, with defaults
    except (TypeError, ValueError):
        return {}


def detect_signature(fn) -> str:
    """Which convention `fn` follows, from its parameter names (see `RewardCall`).

    Exactly one of `responses` (lit-ppo), `completions` (TRL), `solution_str` (verl), `queries` (OpenRLHF)
    decides; a function naming none of them but taking four positional arguments is lit-ppo's
    `(prompts, responses, references, extras)` under other names. Anything else is a ConfigError."""
    return convention_of(_parameters(fn), _name(fn))


def convention_of(parameters: dict[str, inspect.Parameter], name: str) -> str:
    """`detect_signature` on a function's parameters (`name` for the message): also for a class's `__call__`
    that is not built yet (the pre-flight checks, lit_ppo/preflight.py)."""
    found = [convention for convention, marker in SIGNATURE_MARKERS.items() if marker in parameters]
    if len(found) == 1:
        return found[0]
    positional = [
        p
        for p in parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if not found and len(positional) >= 4:
        return "lit_ppo"
    shown = f"({', '.join(parameters)})" if parameters else "(parameters unknown)"
    raise ConfigError(
        f"reward.signature=auto cannot tell how to call {name}{shown}: it names "
        f"{' and '.join(SIGNATURE_MARKERS[f] for f in found) if found else 'none'} of "
        f"{', '.join(SIGNATURE_MARKERS.values())}; fix: set reward.signature to one of {', '.join(SIGNATURES[1:])}, "
        "or give it the parameters of one of them (docs/rewards.md)"
    )


def _as_list(values, n: int, what: str) -> list:
    if hasattr(values, "tolist"):  # a tensor or an array
        values = values.tolist()
    if isinstance(values, (int, float)) and n == 1:
        values = [values]
    try:
        values = list(values)
    except TypeError:
        raise RewardError(
            f"{what} is a {type(values).__name__}, not one value per sample; fix: return a list"
        ) from None
    return values


@dataclass
class RewardCall:
    """The user's reward function, called as the framework it was written for calls it; always returns
    `(scores, metrics)`: one score per sample (a float, or None, see below) and per-sample metric lists.

    - `lit_ppo`: `fn(prompts, responses, references, extras)` -> scores, or (scores, {name: per-sample values}).
    - `trl`: `fn(prompts=..., completions=..., <answer column>=references, **<extra columns>)`, TRL's
      `reward_funcs` contract: the dataset's other columns as keyword lists (`data.answer_key` names the
      reference column, `data.extra_keys` the others; only those the function accepts unless it takes
      **kwargs). Prompts and completions are text. It returns a list of floats, where None means what it
      means in TRL, "this function does not apply to this sample": the sample scores 0 and is counted in
      `rollout/reward_none` (not an error).
    - `verl`: `fn(data_source=..., solution_str=response, ground_truth=reference, extra_info=extras)` per
      sample (verl's `compute_score`); `data_source` is the record's `data_source` field when
      `data.extra_keys` lists it, else "". It returns a number, or a dict whose `score` is the reward
      and whose other numeric entries are logged as `rollout/reward_<key>`.
    - `openrlhf`: `fn(queries, prompts, labels)` on the batch (OpenRLHF's `--remote_rm_url` file):
      queries are prompt + response, labels the references. It returns a tensor or list of rewards, or
      a dict with `rewards` (and optionally `scores`, unused, and `extra_logs`, logged like metrics).
    """

    fn: Callable[..., Any]
    signature: str
    reference_key: str | None = "answer"

    def __call__(self, prompts: list[str], responses: list[str], references: list, extras: list[dict]):
        return getattr(self, f"_{self.signature}")(prompts, responses, references, extras)

    def _lit_ppo(self, prompts, responses, references, extras):
        result = self.fn(prompts, responses, references, extras)
        scores, metrics = result if isinstance(result, tuple) else (result, {})
        return _as_list(scores, len(responses), "the reward"), {
            k: _as_list(v, len(responses), k) for k, v in dict(metrics).items()
        }

    def _accepted(self, keywords: dict) -> dict:
        parameters = _parameters(self.fn)
        if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return keywords
        return {k: v for k, v in keywords.items() if k in parameters}

    def _trl(self, prompts, responses, references, extras):
        columns = {key: [e.get(key) for e in extras] for key in (extras[0] if extras else {})}
        if self.reference_key:
            columns[self.reference_key] = list(references)
        scores = self.fn(prompts=list(prompts), completions=list(responses), **self._accepted(columns))
        return _as_list(scores, len(responses), "the reward"), {}

    def _verl(self, prompts, responses, references, extras):
        scores, metrics = [], defaultdict(list)
        for response, reference, extra in zip(responses, references, extras):
            result = self.fn(
                **self._accepted(
                    {
                        "data_source": extra.get("data_source", ""),
                        "solution_str": response,
                        "ground_truth": reference,
                        "extra_info": dict(extra),
                    }
                )
            )
            if isinstance(result, dict):
                if "score" not in result:
                    raise RewardError(
                        f"{_name(self.fn)} returned a dict without `score` ({sorted(result)}); "
                        "fix: return a number or a dict with `score`, as verl expects"
                    )
                for key, value in result.items():
                    if key != "score" and isinstance(value, (int, float)):
                        metrics[key].append(float(value))
                result = result["score"]
            scores.append(result)
        return scores, {k: v for k, v in metrics.items() if len(v) == len(scores)}

    def _openrlhf(self, prompts, responses, references, extras):
        result = self.fn([p + r for p, r in zip(prompts, responses)], list(prompts), list(references))
        metrics = {}
        if isinstance(result, dict):
            if "rewards" not in result:
                raise RewardError(
                    f"{_name(self.fn)} returned a dict without `rewards` ({sorted(result)}); "
                    "fix: return the rewards, or a dict with `rewards`, as OpenRLHF expects"
                )
            for key, value in (result.get("extra_logs") or {}).items():
                values = (
                    _as_list(value, len(responses), key)
                    if not isinstance(value, (int, float))
                    else [value] * len(responses)
                )
                if len(values) == len(responses):
                    metrics[key] = [float(v) for v in values]
            result = result["rewards"]
        return _as_list(result, len(responses), "the reward"), metrics


# ------------------------------------------------------------------ worker processes


class _Timeout(Exception):
    pass


def _worker_main(conn, call: RewardCall) -> None:
    """A worker process: score one sample at a time in its main thread (where math-verify's SIGALRM
    timeouts work), answer (index, "ok", (scores, metrics)) or (index, "error", (type, message, timed out))."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops the workers
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        index, sample = task
        try:
            scores, metrics = call(*([x] for x in sample))
            reply = (index, "ok", (list(scores), dict(metrics)))
            conn.send(reply)
        except BaseException as e:  # math-verify's TimeoutException is a BaseException
            timed_out = isinstance(e, TimeoutError) or "timeout" in type(e).__name__.lower()
            conn.send((index, "error", (type(e).__name__, str(e)[:2000], timed_out)))


class _Worker:
    def __init__(self, context, call: RewardCall):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, call), daemon=True, name="lit-ppo-reward")
        self.process.start()
        child.close()
        self.ready = False
        self.task: tuple[int, float] | None = None  # (sample index, start time)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()


class RewardWorkers:
    """`workers` processes that score one sample each at a time, each under `timeout_s` seconds.

    A sample whose worker does not answer in time is killed with its worker; a worker that dies
    (os._exit, a segfault, the OOM killer) takes only its sample. Either way a fresh worker replaces
    it. Workers start with `spawn`: forking a process that holds vLLM's and torch's threads is unsafe."""

    START_TIMEOUT_S = 300.0  # importing the reward's module (torch, sympy) on a busy machine

    def __init__(self, call: RewardCall, workers: int, timeout_s: float | None):
        try:
            pickle.dumps(call)
        except Exception as e:
            raise ConfigError(
                f"reward.workers={workers} needs a reward function that can be sent to another process "
                f"({_name(call.fn)}: {e}); fix: use a module-level function or class, or reward.workers=0"
            ) from e
        self.call, self.size, self.timeout_s = call, workers, timeout_s
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.restarts = 0

    def _start_workers(self) -> None:
        self.workers = [w for w in self.workers if w.process.is_alive()]
        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.context, self.call))

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self.workers.remove(worker)
        self.workers.append(_Worker(self.context, self.call))
        self.restarts += 1

    def run(self, samples: list[tuple]) -> list[tuple[str, Any]]:
        """One outcome per sample: ("ok", (scores, metrics)), ("error", (type, message, timed out)),
        ("timeout", message) or ("died", message)."""
        self._start_workers()
        outcomes: list = [None] * len(samples)
        pending = deque(range(len(samples)))
        started = time.monotonic()
        while pending or any(w.task for w in self.workers):
            now = time.monotonic()
            for worker in self.workers:
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    worker.conn.send((index, samples[index]))
                    worker.task = (index, now)
            deadlines = [w.task[1] + self.timeout_s for w in self.workers if w.task and self.timeout_s]
            deadlines += [started + self.START_TIMEOUT_S for w in self.workers if not w.ready]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            wait([w.conn for w in self.workers] + [w.process.sentinel for w in self.workers], timeout)
            now = time.monotonic()
            for worker in list(self.workers):
                message = None
                if worker.conn.poll():
                    try:
                        message = worker.conn.recv()
                    except (EOFError, OSError):
                        message = None
                if message is not None:
                    if message[0] == "ready":
                        worker.ready = True
                        continue
                    index, status, payload = message
                    outcomes[index] = (status, payload)
                    worker.task = None
                elif not worker.process.is_alive():
                    code = worker.process.exitcode
                    if worker.task is None:  # died while starting: the function cannot be loaded there
                        worker.stop()
                        raise RewardError(
                            f"a reward worker process exited with code {code} before scoring anything "
                            f"({_name(self.call.fn)}); fix: make its module importable, or set reward.workers=0"
                        )
                    outcomes[worker.task[0]] = ("died", f"killed its worker process (exit code {code})")
                    self._replace(worker)
                elif worker.task and self.timeout_s and now - worker.task[1] > self.timeout_s:
                    outcomes[worker.task[0]] = ("timeout", f"no result after reward.timeout_s={self.timeout_s:g}s")
                    self._replace(worker)
                elif not worker.ready and now - started > self.START_TIMEOUT_S:
                    raise RewardError(
                        f"reward workers did not start in {self.START_TIMEOUT_S:.0f}s; fix: set reward.workers=0"
                    )
        return outcomes

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.conn.send(None)
            worker.stop()
        self.workers = []


# ------------------------------------------------------------------ in-process calls under a time limit


class _DeadlinePassed(BaseException):
    """Raised inside a reward call that ran past its limit; a BaseException, so that the reward's own
    `except Exception` does not take it for a failure it could score."""


DEADLINE_SIGNAL = signal.SIGUSR2  # not SIGALRM: math-verify times its parsing with SIGALRM in the same thread


def call_with_deadline(fn, timeout_s: float | None):
    """fn() in this (the main) thread, cut after `timeout_s` seconds: a timer thread then signals the main thread,
    whose handler raises inside the call. That stops Python code, sleeps and waits on I/O at once, and a single
    long call into C code (a regex, a solver) when it returns; a call that kills the process is not survived
    (reward.workers > 0 is for those). Raises TimeoutError when cut. Without a limit, or off the main thread
    (where no signal handler runs), fn() is called as it is."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        return fn()
    lock, state = threading.Lock(), {"armed": True, "fired": False}

    def on_signal(signum, frame) -> None:
        if state["armed"] and state["fired"]:
            state["armed"] = False  # once
            raise _DeadlinePassed()

    def fire() -> None:
        with lock:
            if state["armed"]:
                state["fired"] = True
                signal.pthread_kill(threading.main_thread().ident, DEADLINE_SIGNAL)

    previous = signal.signal(DEADLINE_SIGNAL, on_signal)
    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    try:
        try:
            timer.start()
            return fn()
        finally:
            timer.cancel()
            with lock:  # no signal is sent after this; one already sent finds the handler disarmed
                state["armed"] = False
            signal.signal(DEADLINE_SIGNAL, previous)
    except _DeadlinePassed:  # also when it lands while leaving the call
        raise TimeoutError(f"no result after reward.timeout_s={timeout_s:g}s") from None


# ------------------------------------------------------------------ the scorer


@dataclass
class RewardScorer:
    """Calls the user's reward function on a batch and enforces its contract.

    A sample whose reward raises, times out, kills its worker, or is not a finite number stops the run
    (`on_error=raise`, naming the sample) or scores 0 and is counted (`on_error=zero`): `errors` and
    `timeouts` count them over the run, and `metrics["errors"]`, `metrics["timeouts"]` in the last call
    (logged as `rollout/reward_errors`, `rollout/reward_timeouts`). From a TRL-style function a None score
    ("not applicable") scores 0 and is counted in `metrics["none"]`; from the others it is an error.

    `solved` tells which samples solved their prompt (for pass@k): the reward function's own `correct`
    metric when it returns one, else a reward of at least `solved_threshold`."""

    fn: Callable[..., Any]
    on_error: str = "raise"  # raise: stop with the sample; zero: score 0 and count it
    overlong_penalty: float = 0.0  # subtracted from responses that hit the length limit
    # DAPO's soft overlong shaping (`algorithms.overlong_penalty`): off while overlong_buffer_tokens is 0
    overlong_buffer_tokens: int = 0
    overlong_penalty_factor: float = 1.0
    # The end of the overlong buffer: the most tokens a response can have (a whole episode's, turns and observations,
    # with an environment; `RolloutConfig.response_budget_tokens`).
    response_budget_tokens: int = 0
    signature: str = "auto"  # auto | lit_ppo | trl | verl | openrlhf (see RewardCall)
    reference_key: str | None = "answer"  # the reference's column name, for TRL-style functions
    workers: int = 0  # 0: call the function in this process; N: in N worker processes, one sample each
    # workers > 0: per sample (its worker is killed); workers = 0: per call (the batch, then one sample at a time)
    timeout_s: float | None = 60.0
    solved_threshold: float = 1.0  # reward at which a sample counts as solved, without a `correct` metric
    errors: int = 0
    timeouts: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # the last call's per-sample metrics, averaged
    sample_metrics: dict[str, list[float]] = field(default_factory=dict)  # the last call's, per sample

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"reward.on_error={self.on_error!r}; fix: use one of {list(ON_ERROR)}")
        if self.overlong_buffer_tokens and not 0 < self.overlong_buffer_tokens < self.response_budget_tokens:
            raise ConfigError(
                f"reward.overlong_buffer_tokens={self.overlong_buffer_tokens} must lie in (0, {self.response_budget_tokens}) "
                "(the response budget: rollout.max_response_tokens, or rollout.max_episode_tokens with an environment); "
                "fix: e.g. a quarter of the budget, or 0 to turn the shaping off"
            )
        if self.signature not in SIGNATURES:
            raise ConfigError(f"reward.signature={self.signature!r}; fix: use one of {', '.join(SIGNATURES)}")
        if int(self.workers) < 0 or (self.timeout_s is not None and self.timeout_s <= 0):
            raise ConfigError(
                f"reward.workers={self.workers}, reward.timeout_s={self.timeout_s}; "
                "fix: workers >= 0 (0: in process) and timeout_s > 0 or null"
            )
        chosen = detect_signature(self.fn) if self.signature == "auto" else self.signature
        how = "chosen by reward.signature=auto from its parameters" if self.signature == "auto" else "reward.signature"
        log.info("reward: %s, called with the %s signature (%s)", _name(self.fn), chosen, how)
        self.call = RewardCall(self.fn, chosen, self.reference_key)
        self.pool = RewardWorkers(self.call, int(self.workers), self.timeout_s) if self.workers else None

    @classmethod
    def from_config(cls, config: RunConfig) -> RewardScorer:
        """The scorer of a run: the `reward` settings, the references from `data.answer_key`, and the overlong
        shaping measured against the most tokens a response can have (`RolloutConfig.response_budget_tokens`: a
        whole episode's with an environment, not one turn's)."""
        import hydra

        reward = config.reward

        try:
            fn = hydra.utils.instantiate(reward.fn)
        except Exception as e:
            raise ConfigError(
                f"reward.fn: cannot build {reward.fn.get('_target_')!r}: {e}; fix: name an importable "
                "function (with _partial_: true) or callable class by its dotted path"
            ) from e
        if not callable(fn):
            raise ConfigError(
                f"reward.fn built {type(fn).__name__}, which is not callable; fix: add `_partial_: true` "
                "for a function, or name a class with __call__"
            )
        return cls(
            fn=fn,
            on_error=reward.on_error,
            overlong_penalty=reward.overlong_penalty,
            overlong_buffer_tokens=reward.overlong_buffer_tokens,
            overlong_penalty_factor=reward.overlong_penalty_factor,
            response_budget_tokens=config.rollout.response_budget_tokens(),
            solved_threshold=reward.solved_threshold,
            signature=reward.signature,
            reference_key=config.data.answer_key,
            workers=reward.workers,
            timeout_s=reward.timeout_s,
        )

    def close(self) -> None:
        """Stop the worker processes (they are daemons: they also end with this process)."""
        if self.pool is not None:
            self.pool.close()

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        references: list,
        extras: list[dict],
        truncated: list[bool],
        lengths: list[int] | None = None,
    ) -> list[float]:
        """Scores of the responses; `lengths` (tokens per response) are needed for the overlong shaping."""
        errors_before, timeouts_before = self.errors, self.timeouts
        if self.pool is not None:
            scores, extra_metrics = self._score_in_workers(prompts, responses, references, extras)
        else:
            try:
                result = call_with_deadline(lambda: self.call(prompts, responses, references, extras), self.timeout_s)
            except Exception as batch_error:  # find the sample that fails (or is slow), one by one
                if isinstance(batch_error, TimeoutError):
                    log.warning(
                        "reward: the call on the batch of %d ran past reward.timeout_s=%gs and was cut; scoring its "
                        "samples one at a time, each under the same limit",
                        len(responses),
                        self.timeout_s,
                    )
                scores, extra_metrics = self._score_one_by_one(prompts, responses, references, extras, batch_error)
            else:
                scores, extra_metrics = self._checked(result, len(responses))
        none = 0
        for i, score in enumerate(scores):
            if score is None and self.call.signature == "trl":  # TRL's "does not apply to this sample"
                none += 1
                scores[i] = 0.0
            elif not _is_finite_number(score):
                self._sample_failed(
                    i,
                    prompts,
                    responses,
                    ValueError(
                        f"returned {score!r}, not a finite number (a float, int or bool; not {type(score).__name__})"
                    ),
                )
                scores[i] = 0.0
        scores = [float(s) - self.overlong_penalty * bool(t) for s, t in zip(scores, truncated)]
        if self.overlong_buffer_tokens:
            if lengths is None:
                raise ValueError(
                    "RewardScorer: reward.overlong_buffer_tokens is set but no response lengths were given"
                )
            shaping = overlong_penalty(
                torch.tensor(lengths),
                max_response_tokens=self.response_budget_tokens,
                buffer_tokens=self.overlong_buffer_tokens,
                penalty_factor=self.overlong_penalty_factor,
            )
            scores = [s + float(p) for s, p in zip(scores, shaping)]
        errors, timeouts = self.errors - errors_before, self.timeouts - timeouts_before
        if errors or timeouts:
            log.warning(
                "reward: %d of %d samples scored 0 after reward errors and %d after timeouts (reward.on_error=zero)",
                errors,
                len(scores),
                timeouts,
            )
        self.metrics = {k: float(sum(v) / max(len(v), 1)) for k, v in extra_metrics.items()}
        self.metrics.update(errors=float(errors), timeouts=float(timeouts), none=float(none))
        # Per sample only where every sample has a value (a sample whose reward failed has none).
        self.sample_metrics = {k: [float(x) for x in v] for k, v in extra_metrics.items() if len(v) == len(scores)}
        return scores

    def solved(self, scores: list[float]) -> list[bool]:
        """Per sample of the last call (whose `scores` are given): did it solve its prompt? A well-formatted
        wrong answer can earn reward (`format_weight`), so the reward function's `correct` metric decides
        where there is one; otherwise a reward of at least `solved_threshold`."""
        correct = self.sample_metrics.get("correct")
        if correct is not None and len(correct) == len(scores):
            return [c > 0 for c in correct]
        return [s >= self.solved_threshold for s in scores]

    def _checked(self, result, n: int) -> tuple[list, dict[str, list[float]]]:
        scores, extra_metrics = result
        scores = list(scores)
        if len(scores) != n:
            raise RewardError(
                f"reward function {_name(self.fn)} returned {len(scores)} scores for {n} responses; "
                "fix: return one float per response"
            )
        return scores, dict(extra_metrics)

    def _score_one_by_one(self, prompts, responses, references, extras, batch_error):
        scores, extra_metrics, failed = [], defaultdict(list), 0
        for i in range(len(responses)):
            try:
                one, metrics = self._checked(
                    call_with_deadline(
                        lambda: self.call([prompts[i]], [responses[i]], [references[i]], [extras[i]]), self.timeout_s
                    ),
                    1,
                )
            except Exception as e:
                self._sample_failed(i, prompts, responses, e)
                failed += 1
                scores.append(0.0)
                continue
            scores.extend(one)
            for k, v in metrics.items():
                extra_metrics[k].extend(v)
        if responses and not failed and not isinstance(batch_error, TimeoutError):  # a slow batch, fine one by one
            raise RewardError(
                f"reward function {_name(self.fn)} raised on the batch of {len(responses)} but on no single "
                f"sample: {type(batch_error).__name__}: {batch_error}; fix: make it work on whole batches"
            )
        return scores, extra_metrics

    def _score_in_workers(self, prompts, responses, references, extras):
        outcomes = self.pool.run(list(zip(prompts, responses, references, extras)))
        scores, extra_metrics = [], defaultdict(list)
        for i, (status, payload) in enumerate(outcomes):
            if status == "ok":
                one, metrics = payload
                if len(one) == 1:
                    scores.append(one[0])
                    for k, v in metrics.items():
                        extra_metrics[k].extend(v)
                    continue
                failure, timed_out = RewardError(f"returned {len(one)} scores for 1 response"), False
            elif status == "error":
                name, message, timed_out = payload
                failure = (_Timeout if timed_out else RewardError)(f"{name}: {message}")
            else:
                failure, timed_out = (_Timeout if status == "timeout" else RewardError)(payload), status == "timeout"
            self._sample_failed(i, prompts, responses, failure, timed_out=timed_out)
            scores.append(0.0)
        return scores, extra_metrics

    def _sample_failed(self, i: int, prompts, responses, error: Exception, *, timed_out: bool | None = None) -> None:
        if timed_out is None:
            timed_out = isinstance(error, TimeoutError)
        if self.on_error == "raise":
            what = f"{type(error).__name__}: {error}" if not isinstance(error, (_Timeout, RewardError)) else str(error)
            raise RewardError(
                f"reward function {_name(self.fn)} {'timed out' if timed_out else 'failed'} on sample {i} "
                f"(prompt {_clip(prompts[i])!r}, response {_clip(responses[i])!r}): {what}; fix: correct the function, "
                "or set reward.on_error=zero to score such samples 0"
            ) from error
        if timed_out:
            self.timeouts += 1
        else:
            self.errors += 1
        log.info(
            "reward: sample %d %s and scores 0 (prompt %r, response %r): %s",
            i,  # run.log only: one per sample
            "timed out" if timed_out else "failed",
            _clip(prompts[i], 80),
            _clip(responses[i], 80),
            error,
            extra={"console": False},
        )


def _is_finite_number(x) -> bool:
    """A real number (bool included) that is finite. Text is not one: float("1.0") would take the string "1.0"
    from a function that formats its scores, and "0.5 " or "1,0" next time."""
    if not isinstance(x, numbers.Real):
        item = getattr(x, "item", None)  # a 0-d tensor or NumPy array holds one number
        if getattr(x, "ndim", None) != 0 or item is None:
            return False
        x = item()
        if not isinstance(x, numbers.Real):
            return False
    return math.isfinite(float(x))


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _name(fn) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial from `_partial_: true`
    if not hasattr(inner, "__qualname__"):  # a callable object
        inner = type(inner)
    return f"{getattr(inner, '__module__', '?')}.{inner.__qualname__}"
