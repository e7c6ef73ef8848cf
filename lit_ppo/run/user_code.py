"""The user's code a run names (`reward.fn`, `rollout.episodes.environment`), checked before any model loads: its dotted
path imported, not built (`resolve_target`), and its signature bound, never called, as the run will call it
(`check_bound_keywords`, `check_reward_convention`, `check_environment_convention`). Part of the pre-flight
(`run/prepare.py:preflight` reads the values out of the config; the other checks are lit_ppo/run/preflight.py's);
each function takes plain values and raises a ConfigError naming the key and the fix.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Iterable, Mapping
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from lit_ppo.errors import ConfigError

# ------------------------------------------------------------------ dotted paths


def make_importable(directory: Path) -> None:
    """Put `directory` (the working directory) first on the import path, as `python -m` and Hydra's own
    examples lead users to expect: `reward.fn._target_=my_rewards.score` finds ./my_rewards.py. Worker processes
    started with `spawn` inherit the path."""
    entry = str(directory.resolve())
    if entry not in sys.path:
        sys.path.insert(0, entry)


def _searched() -> str:
    """The import path as a user reads it: the folders searched, the installed packages summarized."""
    folders = [p for p in sys.path if p and "site-packages" not in p and "/lib/python" not in p]
    return ", ".join(folders) + ", then the installed packages"


def resolve_target(dotted: str, key: str) -> Any:
    """The object a `_target_` names (imported, not built); ConfigError naming `key` and where it looked."""
    module_name, _, attribute = str(dotted).rpartition(".")
    if not module_name:
        raise ConfigError(f"{key}._target_={dotted!r} is not a dotted path; fix: name it as module.function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(
                f"{key}._target_={dotted}: no module {e.name!r} on the import path (searched {_searched()}); fix: "
                f"run train.py from the folder holding {e.name.split('.')[0]}/ or {e.name.split('.')[0]}.py, or add "
                "that folder to PYTHONPATH"
            ) from e
        raise ConfigError(
            f"{key}._target_={dotted}: importing {module_name} failed, it needs the module {e.name!r}, which is "
            "not installed; fix: install it in this environment"
        ) from e
    except Exception as e:
        raise ConfigError(
            f"{key}._target_={dotted}: importing {module_name} raised {type(e).__name__}: {e}; fix: correct that module"
        ) from e
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ConfigError(
            f"{key}._target_={dotted}: {module_name} ({getattr(module, '__file__', '?')}) has no {attribute!r}; "
            "fix: name a function or class the module defines"
        ) from None


# ------------------------------------------------------------------ call conventions


def call_parameters(target: Any, bound: Mapping[str, Any], partial: bool) -> dict[str, inspect.Parameter]:
    """The parameters the run will call with: those of a function left after `bound` keywords (Hydra's
    `_partial_: true`), or of a class's `__call__` (its instance, built from `bound`, is what gets called)."""
    if inspect.isclass(target) and not partial:
        call = getattr(target, "__call__", None)  # noqa: B004 - the class's own method, unbound
        if call is None or call is object.__call__:
            return {}
        parameters = list(inspect.signature(call).parameters.values())[1:]  # without self
        return {p.name: p for p in parameters}
    # What functools.partial makes of it: a parameter bound by keyword is still accepted, with a default now, and
    # it and every positional parameter after it become keyword-only (so `def f(a, b, c)` with b bound takes a, then
    # b=..., c=...: a signature in that order, which replacing b's kind alone would not be).
    return dict(inspect.signature(functools.partial(target, **bound)).parameters)


def check_bound_keywords(target: Any, bound: Mapping[str, Any], partial: bool, name: str) -> None:
    """Every keyword set beside reward.fn's `_target_` is a parameter of what it is given to: the function (Hydra's
    `_partial_: true`) or the class's constructor. A misspelt one would otherwise leave the parameter it meant
    unset, and be reported as the function not fitting its convention, or fail at the first rollout."""
    if not bound:
        return
    function = target if partial or not inspect.isclass(target) else target.__init__
    try:
        parameters = dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # no signature to read (a builtin): building it will tell
        return
    if inspect.isclass(target) and not partial:
        parameters.pop(next(iter(parameters), None), None)  # self
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    names = [n for n, p in parameters.items() if p.kind != inspect.Parameter.VAR_POSITIONAL]
    for key in bound:
        if key not in parameters:
            close = get_close_matches(key, names, 1)
            raise ConfigError(
                f"reward.fn.{key}: {name} has no parameter {key!r} (its parameters: {', '.join(names)}); fix: "
                + (f"correct it to reward.fn.{close[0]}" if close else f"remove reward.fn.{key}")
            )


# How lit_ppo.rewards.RewardCall calls each convention (for messages; the binding below mirrors it).
CONVENTION_CALLS = {
    "lit_ppo": "fn(prompts, responses, references, extras)",
    "trl": "fn(prompts=..., completions=..., <data.answer_key>=..., <data.extra_keys>=...)",
    "verl": "fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) per sample",
    "openrlhf": "fn(queries, prompts, labels)",
}


def check_reward_convention(
    parameters: dict[str, inspect.Parameter],
    name: str,
    signature: str,
    reference_key: str | None,
    extra_keys: Iterable[str],
) -> str:
    """The convention `signature` (auto: told from the parameter names) under which the reward function
    will be called, after binding the arguments of that call to `parameters` without calling it; a
    ConfigError naming the function when they do not bind."""
    from lit_ppo.rewards.calling import SIGNATURES, convention_of

    if signature not in SIGNATURES:
        raise ConfigError(f"reward.signature={signature!r}; fix: use one of {', '.join(SIGNATURES)}")
    convention = convention_of(parameters, name) if signature == "auto" else signature
    variadic = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())

    def accepted(keywords: dict) -> dict:
        return keywords if variadic else {k: v for k, v in keywords.items() if k in parameters}

    if convention == "lit_ppo":
        args, kwargs = ([], [], [], []), {}
    elif convention == "trl":
        columns = {k: [] for k in [*(extra_keys or []), *([reference_key] if reference_key else [])]}
        args, kwargs = (), {"prompts": [], "completions": [], **accepted(columns)}
    elif convention == "verl":
        args, kwargs = (), accepted(dict.fromkeys(("data_source", "solution_str", "ground_truth", "extra_info")))
    else:
        args, kwargs = ([], [], []), {}
    try:
        inspect.Signature(list(parameters.values())).bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(
            f"reward.fn: {name}({', '.join(parameters)}) cannot be called as the {convention} convention calls it, "
            f"{CONVENTION_CALLS[convention]}: {e}; fix: give it those parameters (docs/rewards.md) or set "
            "reward.signature to its convention"
        ) from None
    return convention


def check_environment_convention(target: Any, arguments: Mapping[str, Any], name: str) -> None:
    """An environment class (`rollout.episodes.environment._target_`) bound, not built: its constructor takes `arguments`,
    and it has `reset(record)` and `step(action)` (docs/environments.md). A factory function is only bound to
    `arguments` (what it returns is known only by calling it)."""
    try:
        inspect.signature(target).bind(**arguments)
    except TypeError as e:
        raise ConfigError(
            f"rollout.episodes.environment: {name} cannot be built from the arguments {sorted(arguments)}: {e}; fix: give only "
            "the arguments it takes, beside _target_"
        ) from None
    except ValueError:  # no signature to read (a builtin): building it will tell
        return
    if not inspect.isclass(target):
        return
    for method, argument in (("reset", "record"), ("step", "action")):
        function = getattr(target, method, None)
        if not callable(function):
            raise ConfigError(
                f"rollout.episodes.environment: {name} has no {method}({argument}) method; fix: implement the protocol of "
                "docs/environments.md: reset(record) and step(action) -> (observation, reward, done, info)"
            )
        try:
            inspect.signature(function).bind(None, None)  # (self, record) / (self, action)
        except TypeError as e:
            raise ConfigError(
                f"rollout.episodes.environment: {name}.{method} cannot be called as {method}({argument}): {e}; fix: give it "
                f"the signature {method}(self, {argument}) (docs/environments.md)"
            ) from None
        except ValueError:
            continue


def check_environment_turns(has_environment: bool, max_turns: int) -> None:
    """An environment answers between the policy's turns: with one turn it never gets to."""
    if has_environment and max_turns < 2:
        raise ConfigError(
            f"rollout.episodes.environment is set but rollout.episodes.max_turns={max_turns}: an episode ends after the policy's first "
            "turn, so it never reads a tool's result; fix: set rollout.episodes.max_turns to 2 or more (e.g. 4), or "
            "rollout.episodes.environment=null for single-turn responses"
        )
