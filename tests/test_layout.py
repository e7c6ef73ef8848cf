"""tests/ is laid out like the package: the test of `lit_ppo/<side>/<module>.py` is `tests/<side>/test_<module>.py`
(whole runs of train.py in tests/end_to_end/), and test modules share code through the `tests.helpers` package only:
no test module imports another (pytest would import it a second time, under another name, with its fixtures)."""

from __future__ import annotations

import ast

from tests.helpers import ROOT


def imported_modules(source: str) -> set[str]:
    """Every module that `source` imports, anywhere in it (function bodies included), as dotted names."""
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)  # `from tests.rollout import test_x`
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    return imported


def imported_test_modules(imported: set[str]) -> set[str]:
    """The test modules among `imported`: `tests.test_x`, `tests.<side>.test_x`, or `test_x` found through
    pytest's rootdir on sys.path."""
    return {m for m in imported if any(part.startswith("test_") for part in m.split(".")) and "helpers" not in m}


def test_the_check_sees_an_import_of_a_test_module():
    source = "from tests.test_resume import counters\nimport tests.rollout.test_async\ndef f():\n    import test_ddp\n"
    assert imported_test_modules(imported_modules(source)) == {
        "tests.test_resume",
        "tests.test_resume.counters",
        "tests.rollout.test_async",
        "test_ddp",
    }
    assert (
        imported_test_modules(imported_modules("from tests.helpers.resume import counters\nimport lit_ppo.testing\n"))
        == set()
    )


def test_no_test_module_or_benchmark_imports_a_test_module():
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    assert len(files) > 60
    offenders = [
        f"{path.relative_to(ROOT)} imports {sorted(found)}: move what it needs into tests/helpers/"
        for path in files
        if (found := imported_test_modules(imported_modules(path.read_text())))
    ]
    assert offenders == [], "\n".join(offenders)


def test_the_test_folders_are_the_package_sides_and_packages():
    """Every folder of tests/ holding tests names a subpackage of lit_ppo (or is end_to_end/), a side or a package
    inside one (tests/rollout/workers/ for lit_ppo/rollout/workers/), and is a package (`__init__.py`, as are the
    folders above it): pytest then imports `tests/<side>/test_x.py` as `tests.<side>.test_x`, so two sides may each
    have a test_x.py."""
    package = ROOT / "lit_ppo"
    subpackages = {p.relative_to(package) for p in package.rglob("*") if (p / "__init__.py").exists()}
    folders = {p for p in (ROOT / "tests").rglob("*") if p.is_dir() and any(p.glob("test_*.py"))}
    relatives = {f.relative_to(ROOT / "tests").as_posix() for f in folders}
    assert relatives >= {"rollout", "training", "run", "rewards", "end_to_end", "rollout/workers"}
    for folder in folders:
        relative = folder.relative_to(ROOT / "tests")
        assert relative in subpackages or relative.as_posix() == "end_to_end", (
            f"tests/{relative}/ holds tests but is no package of lit_ppo/ ({sorted(map(str, subpackages))}) nor "
            "end_to_end/"
        )
        for above in [relative, *relative.parents][:-1]:
            assert (ROOT / "tests" / above / "__init__.py").exists(), f"tests/{above}/ has no __init__.py"
    assert (ROOT / "tests" / "__init__.py").exists()
