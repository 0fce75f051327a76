"""A workspace's own tests, detected from the files it has (never guessed from a request).

Each detector looks for the files that make a test command meaningful: pytest (a
`conftest.py`, `pytest.ini`, a `[tool.pytest` table, or `test_*.py`/`*_test.py` files),
`npm test` (a package.json with a `test` script), `go test` (go.mod), `cargo test`
(Cargo.toml), `make test` (a Makefile with a `test:` target). Tests run in the sandbox
without the network, so the offline forms are used.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_MAKE_TEST = re.compile(r"^test\s*:", re.M)


def detect(root: Path) -> list[list[str]]:
    found: list[list[str]] = []
    if _has_pytest(root):
        found.append([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"])
    package = root / "package.json"
    if package.is_file():
        try:
            scripts = json.loads(package.read_text(errors="replace")).get("scripts") or {}
        except (ValueError, AttributeError):
            scripts = {}
        if isinstance(scripts, dict) and isinstance(scripts.get("test"), str):
            found.append(["npm", "test", "--silent", "--offline"])
    if (root / "go.mod").is_file():
        found.append(["go", "test", "./..."])
    if (root / "Cargo.toml").is_file():
        found.append(["cargo", "test", "--offline", "--quiet"])
    makefile = root / "Makefile"
    if makefile.is_file() and _MAKE_TEST.search(makefile.read_text(errors="replace")):
        found.append(["make", "test"])
    return found


def _has_pytest(root: Path) -> bool:
    if (root / "conftest.py").is_file() or (root / "pytest.ini").is_file():
        return True
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and "[tool.pytest" in pyproject.read_text(errors="replace"):
        return True
    for pattern in ("test_*.py", "*_test.py"):
        if any(root.glob(pattern)) or any(root.glob(f"tests/{pattern}")):
            return True
    return False
