"""Spawned vLLM servers (lit_ppo/rollout/workers/server_spawn.py): the plugin an editable install declares, a server
that ends with its trainer, and a spawned server's log that starts with its whole command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lit_ppo.rollout.workers.server_spawn import PLUGIN_ENTRY_POINT, spawn_server
from tests.helpers import ROOT
from tests.helpers.servers import BY_HAND


def test_the_editable_install_declares_the_vllm_plugin(tmp_path):
    """`make install` (pip install -e) writes the dist-info that setuptools prepares for an editable build: its
    entry points name lit_ppo_gloo in vLLM's plugin group, so a server in that environment registers the backend."""
    from setuptools import build_meta

    name = build_meta.prepare_metadata_for_build_editable(str(tmp_path))
    entry_points = (tmp_path / name / "entry_points.txt").read_text()
    assert f"[vllm.general_plugins]\n{PLUGIN_ENTRY_POINT}" in entry_points


def test_a_spawned_server_ends_with_its_trainer_even_when_the_trainer_is_killed(tmp_path):
    """A spawned server is started with `end_with_parent` (PR_SET_PDEATHSIG): a trainer killed with SIGKILL, which
    runs no `close`, leaves no server behind (here a stand-in child that would sleep two minutes)."""
    spawn = (
        "import functools, os, subprocess, sys, time\n"
        "from lit_ppo.rollout.workers.server_spawn import end_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " preexec_fn=functools.partial(end_with_parent, os.getpid()), start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True, env=env)
    child = int(trainer.stdout.readline())
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running(child):
        time.sleep(0.1)
    assert not running(child)


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_spawned_servers_log_starts_with_its_whole_command_and_environment(tmp_path, monkeypatch):
    """The first line of `<run>/logs/rollout_server<N>.log` is the command a spawned server runs with the variables it
    gets beside the trainer's (VLLM_CPU_KVCACHE_SPACE, which a CPU server cannot start without, and PYTHONPATH), as a
    shell runs it: pasted, it starts the same server."""
    import shlex

    from lit_ppo.rollout.workers import server_spawn

    started = []

    class Started:  # the process, not started
        pid = 4242

        def __init__(self, command, env, **_):
            started.append((command, env))

    monkeypatch.setattr(server_spawn.subprocess, "Popen", Started)
    settings = {**BY_HAND, "kv_cache_gib": 3}
    spawn_server(0, settings, 1, 1, "127.0.0.1", tmp_path)
    (command, env), line = started[0], (tmp_path / "rollout_server0.log").read_text().splitlines()[0]
    words = shlex.split(line.removeprefix("$ "))
    variables = dict(word.split("=", 1) for word in words[: words.index(command[0])])
    assert words[len(variables) :] == command
    assert variables["VLLM_SERVER_DEV_MODE"] == "1" and variables["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert all(env[k] == v for k, v in variables.items()) and "PYTHONPATH" in variables


def test_a_stale_or_missing_plugin_entry_point_puts_the_current_one_on_a_spawned_servers_path(tmp_path, monkeypatch):
    """An install made before the weight transfer moved declares `lit_ppo_gloo` with the old module's path (this
    project's shared environment did, 2026-11-28): that entry point loads nothing, so it counts as missing and the
    server gets the current one on its PYTHONPATH (`plugin_path`), as an install without the entry point does. Only
    the current value (pyproject.toml's) is taken as installed."""
    import importlib.metadata

    from lit_ppo.rollout.weight_transfer import plugin
    from lit_ppo.rollout.workers import server_spawn

    def declaring(*values):
        points = [importlib.metadata.EntryPoint("lora_hf_hub_resolver", "vllm.plugins:x", "vllm.general_plugins")]
        points += [importlib.metadata.EntryPoint("lit_ppo_gloo", v, "vllm.general_plugins") for v in values]
        return lambda group: importlib.metadata.EntryPoints(points) if group == "vllm.general_plugins" else []

    started = []

    class Started:  # the process, not started
        pid = 4242

        def __init__(self, command, env, **_):
            started.append(env)

    monkeypatch.setattr(server_spawn.subprocess, "Popen", Started)
    for values, installed in (
        (["lit_ppo.rollout.workers.weight_transfer:register"], False),  # the old module, gone
        ([], False),
        ([plugin.PLUGIN_VALUE], True),
    ):
        monkeypatch.setattr(importlib.metadata, "entry_points", declaring(*values))
        assert server_spawn.plugin_installed() is installed, values
        log_dir = tmp_path / str(len(started))
        log_dir.mkdir()
        spawn_server(0, {**BY_HAND, "kv_cache_gib": 1}, 1, 1, "127.0.0.1", log_dir)
        first = started[-1]["PYTHONPATH"].split(os.pathsep)[0]
        assert (first == str(tmp_path / str(len(started) - 1) / "vllm_plugin")) is not installed
    entry_points = tmp_path / "0" / "vllm_plugin" / "lit_ppo_vllm_plugin-0.0.0.dist-info" / "entry_points.txt"
    assert entry_points.read_text() == f"[vllm.general_plugins]\n{PLUGIN_ENTRY_POINT}\n"
    assert PLUGIN_ENTRY_POINT == "lit_ppo_gloo = lit_ppo.rollout.weight_transfer.backend:register"


def test_a_stale_plugin_entry_point_is_named_once_with_its_fix(monkeypatch, caplog):
    """vLLM logs a traceback for an entry point it cannot load (every vLLM process of a stale install, the trainer's
    own engine too): lit-ppo says once per process what it is and how to fix it; nothing for the current value."""
    import importlib.metadata

    from lit_ppo.rollout.weight_transfer import plugin

    monkeypatch.setattr(plugin, "_warned", set())  # (this process's engines may have named the real one)
    old = "lit_ppo.rollout.workers.weight_transfer:register"
    for values in ([plugin.PLUGIN_VALUE], [old], [old]):
        points = [importlib.metadata.EntryPoint("lit_ppo_gloo", v, "vllm.general_plugins") for v in values]
        monkeypatch.setattr(
            importlib.metadata, "entry_points", lambda group, p=points: importlib.metadata.EntryPoints(p)
        )
        plugin.warn_if_stale()
    assert [r.getMessage() for r in caplog.records if r.name == "lit_ppo"] == [
        f"this environment's lit-ppo declares its vLLM plugin as lit_ppo_gloo = {old}, a module that is gone (an "
        "install older than lit_ppo/rollout/weight_transfer/); vLLM logs that it failed to load it; fix: reinstall "
        "lit-ppo (pip install -e ., or make install)"
    ]
