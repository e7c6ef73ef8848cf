"""Small files that each do one thing (issue 49 item 5): no module in lit_ppo/ over MAX_MODULE_LINES lines and no
function over MAX_FUNCTION_LINES lines (its `def` line to its last, decorators not counted), but for the known
exceptions below, each being split elsewhere; an exception that no longer exceeds its limit is taken off the list."""

from __future__ import annotations

import ast

from tests.helpers import ROOT

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80

# No known exceptions are left: issue 49's items split every long module and function.
LONG_MODULES: set[str] = set()
LONG_FUNCTIONS: set[str] = set()


def function_lengths(source: str) -> dict[str, int]:
    """Every function's (and method's) length in lines, by its qualified name in the module (`Class.method`)."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def package_sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(lines per module, lines per function as `module.py:qualified.name`) of lit_ppo/."""
    package = ROOT / "lit_ppo"
    modules, functions = {}, {}
    for path in sorted(package.rglob("*.py")):
        name, source = path.relative_to(package).as_posix(), path.read_text()
        modules[name] = len(source.splitlines())
        functions.update({f"{name}:{f}": n for f, n in function_lengths(source).items()})
    return modules, functions


def test_function_lengths_count_from_the_def_line_to_the_last_and_name_methods_by_their_class():
    source = "@decorated\ndef f():\n    x = 1\n\n    return x\n\n\nclass C:\n    def m(self):\n        def inner():\n            pass\n"
    assert function_lengths(source) == {"f": 4, "C.m": 3, "C.m.inner": 2}


def test_no_module_over_500_lines_and_no_function_over_80_but_the_known_exceptions():
    modules, functions = package_sizes()
    assert len(modules) > 50 and "rollout/datamodule.py" in modules and "rollout/workers/servers.py" in modules
    long_modules = {name for name, n in modules.items() if n > MAX_MODULE_LINES}
    long_functions = {name for name, n in functions.items() if n > MAX_FUNCTION_LINES}
    assert {f"{m} ({modules[m]} lines)" for m in long_modules - LONG_MODULES} == set()
    assert {f"{f} ({functions[f]} lines)" for f in long_functions - LONG_FUNCTIONS} == set()
    # Split since: take them off the lists.
    assert LONG_MODULES - long_modules == set() and LONG_FUNCTIONS - long_functions == set()
