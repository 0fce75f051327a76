"""What a read-only command must leave as it found: every file of a state dir, by content."""

from __future__ import annotations

import hashlib
from pathlib import Path


def hashes(state_dir: Path) -> dict[str, str]:
    """SHA-256 of every file under `state_dir`, by relative path (plus each file's mode)."""
    return {
        str(path.relative_to(state_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
        + f" {path.stat().st_mode:o}"
        for path in sorted(state_dir.rglob("*"))
        if path.is_file()
    }
