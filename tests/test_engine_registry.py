"""The engine registry (lit_ppo/engine_registry.py): one row per (rollout.engine, launch), each naming how the engine
starts and what follows from it; nothing outside config validation and the plan's rows branches on an engine's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lit_ppo.engine_registry import COLOCATED, ENGINES, HF, REGISTRY, VLLM, resolve
from lit_ppo.memory import MemoryInputs
from tests.helpers import ROOT

ALLOWED = ("lit_ppo/config/", "lit_ppo/plan/", "lit_ppo/engine_registry.py")
"""Where an engine's name may be compared: config validation, the plan's rows, and the registry itself."""


def test_every_engine_has_a_row_for_each_launch_the_config_allows():
    workers = {(name, launch) for name in ENGINES for launch in ("spawn", "external")}
    assert set(REGISTRY) == {(name, COLOCATED) for name in ENGINES} | workers | {("vllm", "server")}
    assert all(key == (row.engine.name, row.launch) for key, row in REGISTRY.items())


@pytest.mark.parametrize("key", sorted(REGISTRY), ids=lambda k: f"{k[0]}-{k[1]}")
def test_every_function_a_row_names_exists(key):
    row = REGISTRY[key]
    for path in (row.start, row.engine.worker_settings, row.engine.worker_start):
        assert callable(resolve(path)), path


def test_a_worker_engine_joins_the_push_with_each_of_its_processes():
    assert VLLM.processes_per_worker({"tensor_parallel_size": 2}) == 2
    assert HF.processes_per_worker({"tensor_parallel_size": 2}) == 1


def engine_name_branches(path: Path, names: set[str]) -> list[str]:
    """Comparisons with an engine's name (`x == "hf"`, `x in ("vllm", ...)`) and `case "hf":` in a module."""
    found = []

    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators]):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.MatchValue) and named(node.value):
            found.append(f"{path.name}:{node.lineno}: case {ast.unparse(node.value)}")
    return found


def test_no_branch_on_an_engines_name_outside_config_and_plan(tmp_path):
    branching = tmp_path / "branching.py"
    branching.write_text(
        'if rollout.engine == "hf":\n    pass\nok = name in ("vllm", "sglang")\nmatch engine:\n    case "vllm":\n'
        "        pass\nfine = flag == 'other'\n"
    )
    assert len(engine_name_branches(branching, set(ENGINES))) == 3  # the check sees each kind of branch
    modules = [p for p in sorted((ROOT / "lit_ppo").rglob("*.py")) if not str(p.relative_to(ROOT)).startswith(ALLOWED)]
    assert len(modules) > 50
    assert [b for path in modules for b in engine_name_branches(path, set(ENGINES))] == []


def test_every_engine_has_its_own_config_section():
    """An engine's settings live in its own section, `rollout.<Engine.section>`: a dataclass field of RolloutConfig,
    present in conf/rollout/vllm.yaml with the dataclass's defaults, and the section `engine_settings` gives a run of
    that engine; no setting of one engine sits flat in `rollout` under another's name."""
    import dataclasses
    import typing

    import yaml

    from lit_ppo.config import RolloutConfig

    fields = typing.get_type_hints(RolloutConfig)
    defaults = yaml.safe_load((ROOT / "conf" / "rollout" / "vllm.yaml").read_text())
    sections = {engine.section for engine in ENGINES.values()}
    assert len(sections) == len(ENGINES)
    for name, engine in ENGINES.items():
        section = fields[engine.section]
        assert dataclasses.is_dataclass(section), engine.section
        assert defaults[engine.section] == dataclasses.asdict(section())
        rollout = RolloutConfig(engine=name)
        assert rollout.engine_settings() is getattr(rollout, engine.section)
        memory_inputs = {f.name for f in dataclasses.fields(MemoryInputs)}
        assert set(section().memory_inputs()) <= memory_inputs  # what the memory estimate reads of it


def engine_section_reads(path: Path, sections: set[str]) -> set[str]:
    """The engine sections a module reads: `x.<section>` for each engine's section name (`rollout.vllm`)."""
    tree = ast.parse(path.read_text())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in sections}


def test_nothing_outside_config_and_plan_reads_another_engines_section(tmp_path):
    """Outside config and the plan, an engine's section is read by that engine's own modules alone (those its
    registry row names); the rest reads the run's engine's section through `RolloutConfig.engine_settings()`."""
    sections = {engine.section for engine in ENGINES.values()}
    own: dict[Path, set[str]] = {}
    for engine in ENGINES.values():
        for path in (engine.worker_settings, engine.worker_start):
            module = ROOT / (path.split(":")[0].replace(".", "/") + ".py")
            own.setdefault(module, set()).add(engine.section)
    reading = tmp_path / "reading.py"
    reading.write_text("size = datamodule.rollout.hf.max_batch_sequences\nshare = rollout.vllm.kv_cache_gib\n")
    assert engine_section_reads(reading, sections) == {"hf", "vllm"}  # the check sees a read
    modules = [p for p in sorted((ROOT / "lit_ppo").rglob("*.py")) if not str(p.relative_to(ROOT)).startswith(ALLOWED)]
    read = {p.relative_to(ROOT).as_posix(): engine_section_reads(p, sections) - own.get(p, set()) for p in modules}
    assert {path: found for path, found in read.items() if found} == {}
    engine_modules = {p.relative_to(ROOT).as_posix(): engine_section_reads(p, sections) for p in own}
    assert engine_modules == {"lit_ppo/rollout/engine.py": {"vllm"}, "lit_ppo/rollout/hf_engine.py": {"hf"}}
