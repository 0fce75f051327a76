"""The bearer token that guards the opt-in TCP listener (unix-socket peers are trusted)."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

TOKEN_FILE = "http.token"


def token_path(state_dir: Path) -> Path:
    return state_dir / TOKEN_FILE


def read_token(state_dir: Path) -> str | None:
    try:
        return token_path(state_dir).read_text().strip() or None
    except FileNotFoundError:
        return None


def load_or_create_token(state_dir: Path) -> str:
    """The token in the state dir, created 0600 (atomically, never world-readable) if missing."""
    existing = read_token(state_dir)
    if existing:
        return existing
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    tmp = state_dir / f".{TOKEN_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, token_path(state_dir))
    return token


def bearer_ok(header: str | None, token: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), token.encode())
