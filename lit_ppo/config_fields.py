"""What a config field accepts: every value Hydra hands over is read as its dataclass field's type (`read_field`),
and a number is checked against the range written beside its field (`field(default=8, metadata=at_least(1))`).

Hydra parses only `true` and `false` as booleans and hands any other word over as a string, which a field that took
what it got would test for truth (`ppo.packing=off` would pack). So a boolean accepts the YAML spellings true/false,
yes/no, on/off (any case) and nothing else; an integer refuses 8.5 and reads "8"; a float reads "1e-6"; a choice
(`Literal`) is one of its choices; `X | None` is X or null; `list[X]` a list of X. A refusal is one ConfigError line
naming the key, the value and what the key accepts. `parse_section` (lit_ppo/config/parse.py) calls `read_field` for every
key it is given, so the dataclasses' own checks (`__post_init__`) see values of their types.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lit_ppo.errors import ConfigError

BOOLEAN_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


def as_boolean(value: Any) -> bool | None:
    """`value` as a boolean: a bool, or a YAML spelling of one (true/false, yes/no, on/off, any case); else None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return BOOLEAN_WORDS.get(value.strip().lower())
    return None


@dataclass(frozen=True)
class Range:
    """The numbers a field accepts: from `low` to `high` (None: unbounded), each end included unless open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""
    """Said after the range in a refusal, when the bound is not obvious (whose limit it is)."""

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low:g}, {self.high:g}{right}"


def at_least(low: float, why: str = "") -> dict:
    """A field's metadata: numbers >= `low`."""
    return {"range": Range(low=low, why=why)}


def above(low: float, why: str = "") -> dict:
    """A field's metadata: numbers > `low`."""
    return {"range": Range(low=low, low_open=True, why=why)}


def within(low: float, high: float, *, low_open: bool = False, why: str = "") -> dict:
    """A field's metadata: numbers from `low` to `high` (both included unless `low_open`)."""
    return {"range": Range(low=low, high=high, low_open=low_open, why=why)}


class NotAccepted(Exception):
    """A value that its field's type does not accept (`coerce`); `read_field` names the key."""


def coerce(value: Any, hint: Any) -> Any:
    """`value` read as the type `hint` names (see the module docstring), or NotAccepted."""
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in arguments:
            return None
        for arm in arguments:
            if arm is type(None):
                continue
            try:
                return coerce(value, arm)
            except NotAccepted:
                continue
        raise NotAccepted
    if origin is Literal:
        for choice in arguments:
            if type(value) is type(choice) and value == choice:  # True is not 1, "1" is not 1
                return value
        raise NotAccepted
    if dataclasses.is_dataclass(hint):  # a nested section: built by parse_section from a mapping
        if isinstance(value, hint):
            return value
        raise NotAccepted
    if hint is bool:
        boolean = as_boolean(value)
        if boolean is None:
            raise NotAccepted
        return boolean
    if hint is int:
        return _integer(value)
    if hint is float:
        return _number(value)
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # `strategy.precision=32`, a path `2024`
            return str(value)
        raise NotAccepted
    if hint is list or origin is list:
        if not isinstance(value, (list, tuple)):
            raise NotAccepted
        item = arguments[0] if arguments else Any
        return [coerce(v, item) for v in value]
    if hint is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise NotAccepted
        return dict(value)
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool):
        raise NotAccepted
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():  # 1e3 from the command line
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise NotAccepted from None
    raise NotAccepted


def _number(value: Any) -> float | int:
    if isinstance(value, bool):
        raise NotAccepted
    if isinstance(value, int):  # an int is a float's value (PEP 484), and says 0 where 0 was written
        return value
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        try:
            number = float(value.strip())  # 1e-6 (YAML 1.1 reads it as a string)
        except ValueError:
            raise NotAccepted from None
    else:
        raise NotAccepted
    if not math.isfinite(number):
        raise NotAccepted
    return number


PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def accepts(hint: Any, limits: Range | None = None) -> str:
    """What a field of type `hint` (and range `limits`) accepts, in words: "an integer >= 1", "a number in [0.01, 2]",
    "true or false (also yes/no, on/off), or null", "one of raise, zero", "a string or a list of strings"."""
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        arms = [accepts(a, limits) for a in arguments if a is not type(None)]
        said = " or ".join(arms)
        return f"{said}, or null" if type(None) in arguments else said
    if origin is Literal:
        return "one of " + ", ".join(str(c) for c in arguments)
    if dataclasses.is_dataclass(hint):
        return "a mapping of its keys (" + ", ".join(f.name for f in dataclasses.fields(hint)) + ")"
    if hint is bool:
        return "true or false (also yes/no, on/off)"
    if hint in (int, float):
        said = "an integer" if hint is int else "a number"
        return f"{said} {limits}" if limits else said
    if hint is str:
        return "a string"
    if hint is list or origin is list:
        item = arguments[0] if arguments else Any
        return "a list" + (f" of {PLURALS[item]}" if item in PLURALS else "")
    if hint is dict or origin is dict:
        return "a mapping"
    return str(hint)


def hydra_text(value: Any) -> str:
    """`value` as it is written on the command line: true, null, [q_proj,v_proj]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_text(v) for v in value) + "]"
    return str(value)


def read_field(key: str, value: Any, hint: Any, field: dataclasses.Field) -> Any:
    """`value` of the config key `key` read as its field's type `hint` and checked against the field's range
    (`field.metadata["range"]`), or a one-line ConfigError naming the key, the value and what the key accepts."""
    limits = field.metadata.get("range")
    try:
        read = coerce(value, hint)
    except NotAccepted:
        read = NotAccepted
    out_of_range = (
        read is not NotAccepted
        and limits is not None
        and isinstance(read, (int, float))
        and not isinstance(read, bool)
        and read not in limits
    )
    if read is not NotAccepted and not out_of_range:
        return read
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = dataclasses.MISSING
    if dataclasses.is_dataclass(default) or isinstance(default, dict):
        fix = f"set its keys, {key}.<key>=<value>"
    elif default is dataclasses.MISSING:
        fix = f"set {key} to {accepts(hint, limits)}"
    else:
        fix = f"e.g. {key}={hydra_text(default)}"
    why = f" ({limits.why})" if limits is not None and limits.why else ""
    raise ConfigError(f"{key}={value!r} is not {accepts(hint, limits)}{why}; fix: {fix}")
