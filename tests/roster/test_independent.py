"""The roster package depends on nothing of the daemon's (data flows one way), except
`daemon.files`, the one atomic file writer, which itself imports only the standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import roster


def test_the_roster_package_imports_nothing_from_the_daemon() -> None:
    for path in Path(roster.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [
                    f"{node.module}.{a.name}" if node.module == "daemon" else node.module
                    for a in node.names
                ]
            for name in names:
                if name == "daemon.files":
                    continue
                assert not name.startswith(("daemon", "surfaces")), f"{path.name} imports {name}"


def test_the_shared_file_writer_imports_only_the_standard_library() -> None:
    import daemon.files

    tree = ast.parse(Path(daemon.files.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            assert node.module.split(".")[0] in {"__future__", *sys.stdlib_module_names}, (
                node.module
            )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] in sys.stdlib_module_names, alias.name
