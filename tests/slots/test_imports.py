"""The slot package's modules import one another without a cycle (none hidden behind
TYPE_CHECKING or inside a function either), and each imports on its own in a fresh process."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "daemon" / "slots"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def imports_of(module: str) -> set[str]:
    """Every daemon.slots module `module` imports, wherever the import statement stands."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            head, _, rest = name.partition("daemon.slots.")
            if not head and rest.split(".")[0] in MODULES:
                found.add(rest.split(".")[0])
    return found - {module}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for dep in sorted(graph[node]):
            found = visit(dep, [*path, node])
            if found is not None:
                return found
        done.add(node)
        return None

    for module in sorted(graph):
        found = visit(module, [])
        if found is not None:
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_within_daemon_slots() -> None:
    graph = {m: imports_of(m) for m in MODULES}
    assert {"member", "lease", "queue", "instance"} <= graph["pool"]  # the graph is read
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_no_imports_hidden_behind_type_checking() -> None:
    for module in MODULES:
        assert "TYPE_CHECKING" not in (PACKAGE / f"{module}.py").read_text(), module


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_on_its_own(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import daemon.slots.{module}"],
        cwd=PACKAGE.parents[1],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
