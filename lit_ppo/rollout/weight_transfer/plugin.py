"""lit-ppo's vLLM general plugin, which registers the `lit_ppo_gloo` backend (backend.py) in every process vLLM starts
(pyproject.toml's entry point): what the installed lit-ppo declares of it. Import-light (importlib.metadata only)."""

from __future__ import annotations

import importlib.metadata
import logging

log = logging.getLogger("lit_ppo")

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME, PLUGIN_VALUE = "lit_ppo_gloo", "lit_ppo.rollout.weight_transfer.backend:register"
PLUGIN_ENTRY_POINT = f"{PLUGIN_NAME} = {PLUGIN_VALUE}"
"""The entry point as pyproject.toml declares it (tests/rollout/workers/test_server_spawn.py checks the two agree)."""
_warned: set[str] = set()


def declared_values() -> list[str]:
    """The values this environment's installs declare for `lit_ppo_gloo` in vLLM's plugin group."""
    return [ep.value for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]


def plugin_installed() -> bool:
    """Whether the installed lit-ppo declares the plugin as this checkout does (the same value), so that a vLLM
    process in this environment registers the backend with nothing more. An install older than the entry point, or
    than its module's move (its value names a module that is gone), is not."""
    return PLUGIN_VALUE in declared_values()


def warn_if_stale() -> None:
    """Once per process, one line where an install older than the weight transfer's move declares the plugin with the
    old module: vLLM logs a traceback as it fails to load it (the backend still registers in this process, on import)."""
    for value in declared_values():
        if value != PLUGIN_VALUE and value not in _warned:
            _warned.add(value)
            log.warning(
                "this environment's lit-ppo declares its vLLM plugin as %s = %s, a module that is gone (an install "
                "older than lit_ppo/rollout/weight_transfer/); vLLM logs that it failed to load it; fix: reinstall "
                "lit-ppo (pip install -e ., or make install)",
                PLUGIN_NAME,
                value,
            )
