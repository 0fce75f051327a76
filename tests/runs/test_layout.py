"""The run's steps depend on the engine's setting, never on the engine (data flows one way)."""

from __future__ import annotations

import ast
from pathlib import Path

import daemon.runs

PACKAGE = Path(daemon.runs.__file__).parent


def imported(path: Path) -> set[str]:
    """Every module `path` imports, `from a import b` counted as both `a` and `a.b`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_module_of_the_runs_package_imports_the_engine() -> None:
    modules = [p for p in PACKAGE.glob("*.py") if p.name not in ("engine.py", "__init__.py")]
    assert {"routing.py", "planning.py", "attempts.py", "synthesis.py"} <= {p.name for p in modules}
    for path in modules:
        assert "daemon.runs.engine" not in imported(path), f"{path.name} imports the engine"


def test_the_runs_package_imports_nothing_above_it() -> None:
    for path in PACKAGE.glob("*.py"):
        for name in imported(path):
            assert not name.startswith(("surfaces", "daemon.tools", "daemon.service")), (
                f"{path.name} imports {name}"
            )
