"""No import circle in the package: every module imports first, on its own (a circle fails for one of its members
when that member is imported before the others)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

IMPORT_EACH_FIRST = """
import importlib, pkgutil, sys
import lit_ppo
names = sorted(m.name for m in pkgutil.walk_packages(lit_ppo.__path__, "lit_ppo."))
for name in names:
    for loaded in [k for k in sys.modules if k == "lit_ppo" or k.startswith("lit_ppo.")]:
        del sys.modules[loaded]  # third-party modules stay loaded: only the package's own order matters
    importlib.import_module(name)
print(len(names))
"""


def test_every_module_imports_first():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_FIRST], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) >= 25  # all of them were tried


def lit_ppo_import_graph() -> dict[str, set[str]]:
    """Module -> the lit_ppo modules it imports anywhere in its source (functions and `if TYPE_CHECKING:` blocks
    included: a circle kept alive by type hints is still a circle in the design)."""
    import ast

    graph: dict[str, set[str]] = {}
    package = ROOT / "lit_ppo"
    for path in sorted(package.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lit_ppo"):
                imported.add(node.module)
                imported.update(f"{node.module}.{a.name}" for a in node.names)  # `from lit_ppo import x`
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name.startswith("lit_ppo"))
        graph[name] = imported
    return {name: {m for m in imported if m in graph and m != name} for name, imported in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle_even_through_type_hints():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check sees a circle
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = lit_ppo_import_graph()
    assert len(graph) >= 25 and "lit_ppo.plan" in graph["lit_ppo.run.build"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# lit_ppo/plan/: the modules above the sections (StepPlan and compute_plan, the run-time checks, older plan.json).
PLAN_ABOVE_SECTIONS = {"lit_ppo.plan", "lit_ppo.plan.step", "lit_ppo.plan.checks", "lit_ppo.plan.records"}


def test_each_plan_section_is_a_short_module_that_never_reaches_back_for_the_whole_plan():
    """The plan is one module per section (its dataclass, its computation, its rows); StepPlan hands each section's
    rows the counts they read, so no section module imports StepPlan's (lit_ppo/plan/step.py)."""
    graph = lit_ppo_import_graph()
    sections = {m for m in graph if m.startswith("lit_ppo.plan.") and m not in PLAN_ABOVE_SECTIONS}
    assert {"lit_ppo.plan.counts", "lit_ppo.plan.layout", "lit_ppo.plan.lora", "lit_ppo.plan.workers"} <= sections
    assert sorted(m for m in sections if graph[m] & PLAN_ABOVE_SECTIONS) == []
    lines = {path.name: len(path.read_text().splitlines()) for path in (ROOT / "lit_ppo" / "plan").glob("*.py")}
    assert {name: n for name, n in lines.items() if n > 500} == {}
    assert rows_taking_the_whole_plan(sections) == []


def rows_taking_the_whole_plan(modules: set[str]) -> list[str]:
    """The `rows` (and `*_rows`) functions of `modules` that take the whole plan (a parameter named plan, or annotated
    StepPlan) instead of the counts they read."""
    import ast

    found = []
    for module in sorted(modules):
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and (node.name == "rows" or node.name.endswith("_rows")):
                for arg in node.args.args + node.args.kwonlyargs:
                    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                    if arg.arg == "plan" or "StepPlan" in annotation:
                        found.append(f"{module}.{node.name}({arg.arg})")
    return found


def test_rollout_and_training_never_import_each_other():
    """The two sides of a rollout step meet only at lit_ppo.batch.RolloutBatch (and the spine above them)."""
    graph = lit_ppo_import_graph()
    for side, other in (("lit_ppo.rollout", "lit_ppo.training"), ("lit_ppo.training", "lit_ppo.rollout")):
        crossing = sorted(
            f"{module} -> {imported}"
            for module, imports in graph.items()
            if module == side or module.startswith(side + ".")
            for imported in imports
            if imported == other or imported.startswith(other + ".")
        )
        assert crossing == [], crossing
    assert any(m.startswith("lit_ppo.rollout.") for m in graph) and any(
        m.startswith("lit_ppo.training.") for m in graph
    )


# The floors of the house: a module imports from its own floor or below, never above. The shared top-level modules
# (batch, contract, algorithms, ...) and the config and plan packages at the bottom; the rewards, which know no rollout
# and no trainer; the two sides of a rollout step (rollout/, training/: never each other, the test above) and the demo
# task; then run/, which assembles them, with testing.py (stand-ins for tests and benchmarks, a data module among them); train.py is
# outside the package, above everything.
FLOORS = {"config": 0, "plan": 0, "rewards": 1, "rollout": 2, "training": 2, "demo": 2, "run": 3, "testing": 3}
# Arrows up that are known, each with why it is there and when it goes.
KNOWN_UPWARD: set[tuple[str, str]] = set()  # none left: an arrow up fails the test below


def floor_of(module: str) -> int:
    """lit_ppo.<x> or lit_ppo.<x>.<...>: the floor of x (0 for a shared top-level module, and for lit_ppo itself)."""
    parts = module.split(".")
    return FLOORS.get(parts[1], 0) if len(parts) > 1 else 0


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} (floor {floor_of(module)}) -> {imported} (floor {floor_of(imported)})"
        for module, imports in graph.items()
        for imported in imports
        if floor_of(imported) > floor_of(module) and (module, imported) not in KNOWN_UPWARD
    )


def test_no_import_runs_up_the_floors():
    assert upward_imports({"lit_ppo.plan": {"lit_ppo.run.build"}, "lit_ppo.run.build": {"lit_ppo.plan"}}) == [
        "lit_ppo.plan (floor 0) -> lit_ppo.run.build (floor 3)"
    ]  # the check sees an arrow up, and lets one down through
    assert upward_imports({"lit_ppo.rewards.scorer": {"lit_ppo.rollout.prompts"}}) != []
    graph = lit_ppo_import_graph()
    sides = {module.split(".")[1] for module in graph if module.count(".") >= 2}
    assert sides <= set(FLOORS), f"a subpackage without a floor: {sorted(sides - set(FLOORS))}; add it to FLOORS"
    assert upward_imports(graph) == []
    still_there = {(m, i) for m, i in KNOWN_UPWARD if i in graph.get(m, set())}
    assert still_there == KNOWN_UPWARD, f"gone, drop from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - still_there)}"


def test_the_weight_transfer_is_a_floor_below_the_engines_and_the_workers():
    """lit_ppo/rollout/weight_transfer/ imports nothing else of lit_ppo.rollout; the engines (a worker's end of the push)
    import it and never the workers, which import both."""
    graph = lit_ppo_import_graph()
    transfer = {m for m in graph if m.startswith("lit_ppo.rollout.weight_transfer")}
    assert {"lit_ppo.rollout.weight_transfer.backend", "lit_ppo.rollout.weight_transfer.transport"} <= transfer
    above = sorted(
        f"{m} -> {i}"
        for m in transfer
        for i in graph[m]
        if i.startswith("lit_ppo.rollout") and not i.startswith("lit_ppo.rollout.weight_transfer")
    )
    assert above == []
    engines = ("lit_ppo.rollout.engine", "lit_ppo.rollout.hf_engine")
    assert sorted(f"{m} -> {i}" for m in engines for i in graph[m] if i.startswith("lit_ppo.rollout.workers")) == []
