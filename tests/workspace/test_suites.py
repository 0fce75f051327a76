"""A workspace's own tests, detected from its files alone."""

from __future__ import annotations

import json
from pathlib import Path

from daemon.workspace.suites import detect


def test_each_kind_of_project_is_detected_from_its_files(tmp_path: Path) -> None:
    assert detect(tmp_path) == []
    (tmp_path / "README.md").write_text("run the tests with pytest\n")  # words are not files
    assert detect(tmp_path) == []
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test(): pass\n")
    (tmp_path / "package.json").write_text(json.dumps({"scripts": {"test": "node --test"}}))
    (tmp_path / "go.mod").write_text("module x\n")
    (tmp_path / "Cargo.toml").write_text("[package]\n")
    (tmp_path / "Makefile").write_text("all:\n\ttrue\n\ntest: all\n\ttrue\n")
    found = [" ".join(argv[1:3]) if "pytest" in argv else argv[0] for argv in detect(tmp_path)]
    assert found == ["-m pytest", "npm", "go", "cargo", "make"]


def test_near_misses_are_not_tests(tmp_path: Path) -> None:
    (tmp_path / "package.json").write_text(json.dumps({"scripts": {"build": "tsc"}}))
    (tmp_path / "Makefile").write_text("build:\n\ttrue\n# test: later\n")
    (tmp_path / "setup.py").write_text("")
    assert detect(tmp_path) == []
    (tmp_path / "package.json").write_text("{not json")
    assert detect(tmp_path) == []
