"""The roster package depends on nothing of the daemon's (data flows one way)."""

from __future__ import annotations

import ast
from pathlib import Path

import roster


def test_the_roster_package_imports_nothing_from_the_daemon() -> None:
    for path in Path(roster.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(("daemon", "surfaces")), f"{path.name} imports {name}"
