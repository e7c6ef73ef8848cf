"""Reading a config section's values into its dataclass (`parse_section`: unknown keys, unset values and values of
the wrong type or range refused in one line), and the check every section shares (`positive`)."""

from __future__ import annotations

import dataclasses
import typing
from difflib import get_close_matches
from typing import Any, Mapping

from lit_ppo.config_fields import read_field
from lit_ppo.errors import ConfigError

MISSING = "???"  # Hydra's mark of a value the user must set


def positive(section: str, **values: Any) -> None:
    """Refuse anything but a positive integer, naming the key."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(
                f"{section}.{key}={value!r} must be a positive integer; fix: set {section}.{key} to 1 or more"
            )


def limit_seconds(key: str, value: float | None) -> None:
    """Refuse a time limit that is not positive, naming the key (None: no limit)."""
    if value is not None and value <= 0:
        raise ConfigError(f"{key}={value}; fix: a positive number of seconds, or null for no limit")


def close_match_hints(wrong: list[str], names: list[str], prefix: str = "") -> list[str]:
    """`<prefix><wrong> (did you mean <prefix><name>?)` for each wrong name with a close match among `names`."""
    return [
        f"{prefix}{w} (did you mean {prefix}{close[0]}?)"
        for w in wrong
        for close in [get_close_matches(w, names, 1)]
        if close
    ]


def parse_section(cls: type, values: Mapping[str, Any], section: str):
    """Build a config dataclass from a section's values, refusing unknown keys, unset (`???`) values and values that
    their field's type or range does not accept (`config_fields.read_field`: `ppo.packing=maybe`,
    `rollout.max_response_tokens=8.5`) with a one-line message; nested sections (`ppo.rollout_correction`,
    `model.tiny`, ...) are dataclasses too."""
    prefix = f"{section}." if section else ""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        hints = close_match_hints(unknown, names, prefix)
        raise ConfigError(
            f"{section or 'config'}: unknown key(s) {', '.join(prefix + k for k in unknown)}; fix: remove them"
            + (f" or correct {', '.join(hints)}" if hints else "")
            + f" (the keys of {section or 'the root'}: {', '.join(names)})"
        )
    types = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(values)
    for name, value in values.items():
        missing = _first_missing(value, f"{prefix}{name}")
        if missing:
            raise ConfigError(
                f"{missing} is not set (???); fix: set {missing}=<value> on the command line or in the config"
            )
        nested = _dataclass_of(types[name])
        if nested is not None and isinstance(value, Mapping):
            values[name] = parse_section(nested, value, f"{prefix}{name}")
        else:  # by the field's type and range, so that `__post_init__` sees values of their types
            values[name] = read_field(f"{prefix}{name}", value, types[name], fields[name])
    return cls(**values)


def _dataclass_of(hint) -> type | None:
    """The dataclass of a field's type hint (`X` or `X | None`), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    candidates = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
    return candidates[0] if len(candidates) == 1 else None


def _first_missing(value, key: str) -> str | None:
    """The first key under `value` still holding Hydra's `???`, else None."""
    if isinstance(value, str) and value == MISSING:
        return key
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _first_missing(v, f"{key}.{k}")
            if found:
                return found
    return None
