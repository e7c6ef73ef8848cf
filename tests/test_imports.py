"""No import circle in the package: every module imports first, on its own (a circle fails for one of its members
when that member is imported before the others)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

IMPORT_EACH_FIRST = """
import importlib, pkgutil, sys
import lit_ppo
names = sorted(f"lit_ppo.{m.name}" for m in pkgutil.iter_modules(lit_ppo.__path__))
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
