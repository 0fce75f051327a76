"""Check a model file against the roster's sha256, hashing each file version only once.

Digests are cached in `<state>/model-digests.json` keyed by path, size and mtime, so a 100 MB
model is hashed on its first start and not on every restart.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from daemon import layout
from daemon.files import PRIVATE, write_atomic

_CHUNK = 1 << 20


class DigestMismatch(ValueError):
    pass


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class DigestCache:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / layout.MODEL_DIGESTS

    def _load(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # a cache: a damaged one is no cache
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def sha256(self, model: Path) -> str:
        st = model.stat()
        key = f"{model.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        cache = self._load()
        if key in cache:
            return cache[key]
        value = file_sha256(model)
        cache[key] = value
        try:  # the cache only saves time: failing to write it is not an error
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(cache, sort_keys=True), mode=PRIVATE)
        except OSError:
            pass
        return value

    def check(self, model: Path, expected: str) -> None:
        actual = self.sha256(model)
        if actual != expected.lower():
            raise DigestMismatch(f"{model}: sha256 {actual} does not match the roster's {expected}")
