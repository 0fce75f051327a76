"""The bearer token that guards the opt-in TCP listener (unix-socket peers are trusted)."""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from daemon import layout
from daemon.files import PRIVATE, write_atomic

TOKEN_FILE = layout.HTTP_TOKEN


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
    write_atomic(token_path(state_dir), token + "\n", mode=PRIVATE)
    return token


def bearer_ok(header: str | None, token: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), token.encode())
