"""Environments for multi-turn episodes: the protocol, a safe calculator tool, and how the loop calls them.

An environment is any object with two methods (docs/environments.md):

    reset(record: dict) -> observation | None
    step(action: str) -> (observation | None, reward: float, done: bool, info: dict)

`record` is the prompt's record: `{"prompt": text as the model saw it, "reference": ..., **data.extra_keys}`.
`action` is the text of the policy's turn (its token ids decoded for reading only: the trainer keeps the ids
vLLM produced); an environment whose class sets `takes_token_ids = True` gets the turn's token ids instead.
An observation is text (tokenized once by the episode loop, wrapped in the chat template's turn separators when
`data.chat_template=true`), token ids marked as such, `TokenIds([...])` (appended as they are), or None. Anything
else (a plain list, a number) is refused: `[12, 7]` from a tool that returns numbers would otherwise be read as
token ids. `reward` adds up over the episode.
`info` may say `tool_call: True` (counted in `rollout/tool_calls`) and carry numbers (logged as means).
An environment may list `stop: list[str]`, texts that end a policy turn; each must be a single token.

`rollout.episodes.environment._target_` names the class (or any callable returning an environment) by dotted path, with
its arguments beside it; one environment is built per episode. Failures (an exception, or a call that takes
longer than `rollout.episodes.environment_timeout_s`) follow `reward.on_error`, like the reward function's.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import threading
import time
from typing import Any, Callable, Protocol, runtime_checkable

from lit_ppo.errors import ConfigError
from lit_ppo.signals import raised_by_code


class TokenIds(tuple):
    """An observation that is token ids of the policy's tokenizer, appended to the episode as they are:
    `return TokenIds([151665, 198]), 0.0, False, {}`. The marker says so explicitly; a plain list is refused,
    since a tool's result that happens to be a list of numbers is not token ids."""

    __slots__ = ()

    def __new__(cls, ids=()):
        return super().__new__(cls, ids)

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"


Observation = str | TokenIds | None


@runtime_checkable
class Environment(Protocol):
    def reset(self, record: dict) -> Observation: ...

    def step(self, action: str) -> tuple[Observation, float, bool, dict]: ...


def build_environment_factory(spec: dict | None):
    """A callable returning a fresh environment per episode, from `rollout.episodes.environment` (a `_target_` node);
    None when there is no environment (single-turn rollouts)."""
    if spec is None:
        return None
    spec = dict(spec)
    target = spec.get("_target_")
    if not target:
        raise ConfigError(
            "rollout.episodes.environment has no _target_; fix: name an environment class by dotted path, e.g. "
            "rollout.episodes.environment._target_=lit_ppo.environments.CalculatorEnvironment"
        )
    import hydra

    try:
        factory = hydra.utils.instantiate({**spec, "_partial_": True})
        probe = factory()
    except Exception as e:
        raise ConfigError(
            f"rollout.episodes.environment: cannot build {target!r}: {e}; fix: name an importable environment "
            "class by its dotted path and give only the arguments it takes"
        ) from e
    if not isinstance(probe, Environment):
        raise ConfigError(
            f"rollout.episodes.environment: {target} built a {type(probe).__name__}, which lacks reset(record) and "
            "step(action); fix: implement the protocol of docs/environments.md"
        )
    return factory


# ------------------------------------------------------------------ calling environments safely


class EnvironmentTimeout(Exception):
    pass


def call_with_timeout(fn, args: tuple, timeout_s: float | None):
    """fn(*args) in a daemon thread, waiting at most `timeout_s` seconds (None: no limit, called inline).

    A call that overruns raises EnvironmentTimeout. Python cannot stop a thread, so a hung call keeps its thread
    (a daemon: it does not keep the process alive at exit); the episode it belonged to is over either way."""
    if timeout_s is None:
        return fn(*args)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="lit-ppo-environment")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EnvironmentTimeout(f"no result after rollout.episodes.environment_timeout_s={timeout_s:g}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def call_all_with_timeout(calls: list[tuple[Callable, tuple]], timeout_s: float | None) -> list[tuple[bool, Any]]:
    """Every fn(*args) of `calls` at once, each in its own daemon thread, waiting at most `timeout_s` seconds for all
    of them together: per call (True, value) or (False, the exception), an EnvironmentTimeout for a call still
    running at the deadline. So a tool that hangs costs one timeout per turn, not one per episode in series.
    `timeout_s=None`: called inline, one after another, with no limit. The episodes' environments are separate
    objects, so they run concurrently only with each other's state, never an episode with itself."""
    if timeout_s is None:
        outcomes = []
        for fn, args in calls:
            try:
                outcomes.append((True, fn(*args)))
            except Exception as e:
                outcomes.append((False, e))
            except KeyboardInterrupt as e:  # raised by the environment's code: the caller names it
                if not raised_by_code(e):
                    raise
                outcomes.append((False, e))
        return outcomes
    finished: list[tuple[bool, Any] | None] = [None] * len(calls)

    def run(i: int, fn, args) -> None:
        try:
            finished[i] = (True, fn(*args))
        except BaseException as e:  # handed to the caller's thread
            finished[i] = (False, e)

    threads = [
        threading.Thread(target=run, args=(i, fn, args), daemon=True, name="lit-ppo-environment")
        for i, (fn, args) in enumerate(calls)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    outcomes = []
    for i, thread in enumerate(threads):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():  # a hung call keeps its thread (Python cannot stop one); its episode is over
            outcomes.append(
                (False, EnvironmentTimeout(f"no result after rollout.episodes.environment_timeout_s={timeout_s:g}s"))
            )
        else:
            outcomes.append(finished[i])
    return outcomes


def check_step_result(result, vocab_size: int | None = None) -> tuple[Observation, float, bool, dict]:
    """The environment's step result, checked: (observation, finite reward, done, info)."""
    if not isinstance(result, tuple) or len(result) != 4:
        raise TypeError(f"step returned {type(result).__name__}, not (observation, reward, done, info)")
    observation, reward, done, info = result
    if isinstance(reward, (str, bytes)):  # float("1.0") would take it
        raise TypeError(f"step returned the reward {reward!r} (a {type(reward).__name__}); return a float")
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"step returned the reward {reward}, not a finite number")
    return check_observation(observation, "step", vocab_size), reward, bool(done), dict(info or {})


def check_observation(observation, method: str, vocab_size: int | None = None) -> Observation:
    """An observation as the protocol allows it: text, `TokenIds` (ints in the vocabulary), or None; anything
    else raises TypeError (ValueError for ids outside `vocab_size`), in one line saying what to return."""
    if observation is None or isinstance(observation, str):
        return observation
    if isinstance(observation, TokenIds):
        bad = [i for i in observation if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise TypeError(f"{method} returned {observation!r}: token ids must be ints, not {bad[0]!r}")
        if vocab_size is not None:
            outside = [i for i in observation if not 0 <= i < vocab_size]
            if outside:
                raise ValueError(
                    f"{method} returned {observation!r}: the id {outside[0]} is outside the tokenizer's "
                    f"{vocab_size} ids; return text (a str) unless these are ids of the policy's tokenizer"
                )
        return observation
    shown = repr(observation)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise TypeError(
        f"{method} returned the observation {shown} (a {type(observation).__name__}); an observation is text, "
        "lit_ppo.environments.TokenIds([...]) for token ids, or None: return str(...) of a tool's result"
    )


# ------------------------------------------------------------------ the calculator


class CalculatorError(ValueError):
    pass


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def safe_arithmetic(
    expression: str, *, max_length: int = 200, max_abs: float = 1e30, max_exponent: int = 100
) -> int | float:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses, computed from its
    syntax tree: no eval/exec, no names, calls or attributes, so model text cannot run code. Bounded so that no
    expression can take long: at most `max_length` characters, exponents at most `max_exponent`, every
    intermediate |value| at most `max_abs`. Raises CalculatorError otherwise."""
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None

    def value(node) -> int | float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            result = node.value
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            result = _UNARY[type(node.op)](value(node.operand))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (
                abs(right) > max_exponent or (abs(left) > 1 and abs(right) * math.log(abs(left)) > math.log(max_abs))
            ):
                raise CalculatorError("power too large")
            try:
                result = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            if isinstance(result, complex):
                raise CalculatorError("complex result")
        else:
            raise CalculatorError(f"{type(node).__name__} is not allowed")
        if abs(result) > max_abs or (isinstance(result, float) and not math.isfinite(result)):
            raise CalculatorError("number too large")
        return result

    result = value(tree)
    if isinstance(result, float) and result.is_integer():
        return int(result)
    return result


_INTEGER = re.compile(r"-?\d+")


class CalculatorEnvironment:
    """A calculator tool. A policy turn that contains `call_start EXPRESSION call_end` is a tool call: the
    observation is `result_format` with the value (or `error_format` with what was wrong, a valid observation,
    not an environment failure), reward 0, not done. Any other turn is the final answer: done, reward 1 when
    its last integer equals the record's reference, else 0 (`info["correct"]`). After `max_calls` tool calls the
    next call is answered with `error_format` ("no more calls")."""

    takes_token_ids = False

    def __init__(
        self,
        call_start: str = "<calc>",
        call_end: str = "</calc>",
        result_format: str = "<result>{}</result>",
        error_format: str = "<result>error: {}</result>",
        max_calls: int = 4,
        answer: str = "last_integer",
    ):
        if not call_start or not call_end:
            raise ConfigError(
                "rollout.episodes.environment.call_start and call_end must be non-empty; fix: e.g. <calc> and </calc>"
            )
        if answer not in ("last_integer", "exact"):
            raise ConfigError(f"rollout.episodes.environment.answer={answer!r}; fix: use last_integer or exact")
        self.call_start, self.call_end = call_start, call_end
        self.result_format, self.error_format = result_format, error_format
        self.max_calls, self.answer = max_calls, answer
        self.stop = [call_end]  # a tool call ends the policy's turn
        self.reference = None
        self.calls = 0

    def reset(self, record: dict) -> Observation:
        self.reference = record.get("reference")
        self.calls = 0
        return None

    def call_text(self, expression: str) -> str:
        """How a tool call is written (used by the warm start's demonstrations)."""
        return f"{self.call_start}{expression}{self.call_end}"

    def step(self, action: str) -> tuple[Observation, float, bool, dict]:
        end = action.rfind(self.call_end)
        start = action.rfind(self.call_start, 0, end) if end >= 0 else -1
        if start >= 0:
            self.calls += 1
            if self.calls > self.max_calls:
                return self.error_format.format("no more calls"), 0.0, False, {"tool_call": True}
            try:
                result = safe_arithmetic(action[start + len(self.call_start) : end])
            except CalculatorError as e:
                return self.error_format.format(e), 0.0, False, {"tool_call": True}
            return self.result_format.format(result), 0.0, False, {"tool_call": True}
        correct = self.is_correct(action)
        return None, float(correct), True, {"tool_call": False, "correct": float(correct)}

    def is_correct(self, answer: str) -> bool:
        if self.reference is None:
            return False
        reference = str(self.reference).strip()
        if self.answer == "exact":
            return answer.strip() == reference
        found = _INTEGER.findall(answer)
        return bool(found) and _INTEGER.fullmatch(reference) is not None and int(found[-1]) == int(reference)


def stop_token_ids_of(environment, tokenizer) -> list[int]:
    """The token ids of the environment's `stop` texts (each must be one token of the tokenizer)."""
    ids = []
    for text in getattr(environment, "stop", None) or []:
        encoded = tokenizer(text, add_special_tokens=False).input_ids
        if len(encoded) != 1:
            raise ConfigError(
                f"rollout.episodes.environment: the turn-ending text {text!r} is {len(encoded)} tokens {encoded}, "
                "not one, so vLLM cannot stop on it as a token; fix: choose a call_end that is a single token "
                "of the model's tokenizer (e.g. a special token such as </tool_call>)"
            )
        ids.append(encoded[0])
    return ids
