"""The example-vector cache and an embeddings answer, as hostile input: a cache file is used
only when every part of it checks, and anything else is rebuilt with the reason kept."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from daemon import embeddings
from daemon.embeddings import EmbeddingError, VectorCache, example_key, vectors_of

DIGEST = "ab" * 32


def saved(tmp_path: Path) -> tuple[VectorCache, dict[str, list[float]]]:
    cache = VectorCache(tmp_path / "embeddings", "embed")
    vectors = {example_key(DIGEST, t): [1.0, -0.5, 0.25] for t in ("one", "two")}
    cache.save(DIGEST, 3, vectors)
    return cache, vectors


def test_saved_vectors_load_back_and_nothing_else_is_left(tmp_path: Path) -> None:
    cache, vectors = saved(tmp_path)
    assert cache.load(DIGEST) == (vectors, None)
    assert sorted(p.name for p in cache.path.parent.iterdir()) == ["embed.json"]
    assert cache.path.stat().st_mode & 0o777 == 0o600
    assert cache.path.parent.stat().st_mode & 0o777 == 0o700


def test_a_missing_file_is_no_problem(tmp_path: Path) -> None:
    assert VectorCache(tmp_path, "embed").load(DIGEST) == ({}, None)


def test_keys_change_with_the_text_and_with_the_model() -> None:
    key = example_key(DIGEST, "deploy the app")
    assert key != example_key(DIGEST, "deploy the app!")
    assert key != example_key("cd" * 32, "deploy the app")
    assert example_key(DIGEST, "deploy the app") == key


def test_another_model_s_file_is_not_used(tmp_path: Path) -> None:
    cache, _ = saved(tmp_path)
    vectors, problem = cache.load("cd" * 32)
    assert vectors == {}
    assert problem is not None
    assert "another model" in problem


def _edit(cache: VectorCache, change: Any) -> None:
    data = json.loads(cache.path.read_text())
    change(data)
    cache.path.write_text(json.dumps(data))


def _first(data: dict[str, Any], value: Any) -> None:
    data["vectors"][next(iter(data["vectors"]))] = value


def _pack(*values: float) -> str:
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda d: d.update(v=2), "not a vector cache (v)"),
        (lambda d: d.update(dim="3"), "not a vector cache (dim)"),
        (lambda d: d.update(dim=10**9), "not a vector cache (dim)"),
        (lambda d: d.update(extra=1), "not a vector cache (extra)"),
        (lambda d: d.update(digest="../../etc"), "not a vector cache (digest)"),
        (lambda d: d["vectors"].update({"NOT-HEX": _pack(1, 2, 3)}), "malformed vector"),
        (lambda d: _first(d, "%%%not base64"), "malformed vector"),
        (lambda d: _first(d, _pack(1, 2)), "malformed vector"),
        (lambda d: _first(d, _pack(1, math.nan, 3)), "malformed vector"),
        (lambda d: _first(d, _pack(1, math.inf, 3)), "malformed vector"),
        (lambda d: _first(d, _pack(0, 0, 0)), "malformed vector"),
        (lambda d: _first(d, [1.0, 2.0, 3.0]), "not a vector cache"),
    ],
)
def test_a_hostile_file_is_rebuilt_with_its_reason(tmp_path: Path, change: Any, said: str) -> None:
    cache, _ = saved(tmp_path)
    _edit(cache, change)
    vectors, problem = cache.load(DIGEST)
    assert vectors == {}
    assert problem is not None
    assert problem.startswith("embed.json: ")
    assert said in problem


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"[]", b"{" * 10_000, b'{"v": 1}'])
def test_garbage_is_rebuilt(tmp_path: Path, raw: bytes) -> None:
    cache = VectorCache(tmp_path, "embed")
    cache.path.write_bytes(raw)
    vectors, problem = cache.load(DIGEST)
    assert vectors == {}
    assert problem is not None
    assert "not a vector cache" in problem


def test_a_huge_file_is_not_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, _ = saved(tmp_path)
    monkeypatch.setattr(embeddings, "MAX_CACHE_BYTES", cache.path.stat().st_size - 1)
    vectors, problem = cache.load(DIGEST)
    assert vectors == {}
    assert problem is not None
    assert "over" in problem


def test_an_unreadable_file_is_rebuilt(tmp_path: Path) -> None:
    cache = VectorCache(tmp_path, "embed")
    cache.path.mkdir()  # a directory where the file should be
    vectors, problem = cache.load(DIGEST)
    assert vectors == {}
    assert problem is not None
    assert "unreadable" in problem


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    cache, vectors = saved(tmp_path)
    with pytest.raises(OverflowError):  # a value float32 cannot hold
        cache.save(DIGEST, 3, {example_key(DIGEST, "x"): [1e300, 0.0, 1.0]})
    assert cache.load(DIGEST) == (vectors, None)
    assert os.listdir(cache.path.parent) == ["embed.json"]


def _answer(*vectors: Any, indexes: list[int] | None = None) -> dict[str, Any]:
    found = indexes if indexes is not None else list(range(len(vectors)))
    return {"data": [{"index": i, "embedding": v} for i, v in zip(found, vectors, strict=True)]}


def test_an_answer_s_vectors_come_back_in_input_order() -> None:
    answer = _answer([0.0, 1.0], [1.0, 0.0], indexes=[1, 0])
    assert vectors_of(answer, 2) == [[1.0, 0.0], [0.0, 1.0]]


@pytest.mark.parametrize(
    ("answer", "count"),
    [
        ({}, 1),
        ({"data": "x"}, 1),
        (_answer([1.0]), 2),
        (_answer([1.0], [1.0], indexes=[0, 0]), 2),
        (_answer([1.0], indexes=[5]), 1),
        (_answer("1.0"), 1),
        (_answer([]), 1),
        (_answer([1.0, "2"]), 1),
        (_answer([1.0, True]), 1),
        (_answer([1.0, math.nan]), 1),
        (_answer([1.0, 1e300]), 1),
        (_answer([0.0, 0.0]), 1),
        (_answer([1.0], [1.0, 2.0]), 2),
        (_answer([1.0] * (embeddings.MAX_DIM + 1)), 1),
    ],
)
def test_a_hostile_answer_is_refused(answer: Any, count: int) -> None:
    with pytest.raises(EmbeddingError):
        vectors_of(answer, count)
