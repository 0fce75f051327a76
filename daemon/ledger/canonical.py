"""Canonical JSON for hashed ledger data.

Hashed data is restricted to a JSON subset on which the stdlib encoder below is byte-equal to
RFC 8785 (JCS): null, bool, str, int with |n| <= 2**53 - 1, list and dict with str keys. Floats
are refused (JCS and Python format them differently), as are lone surrogates (not UTF-8
encodable) and object keys outside the Basic Multilingual Plane (JCS orders keys by UTF-16 code
units, Python by code points; the two orders only differ for such keys).
"""

from __future__ import annotations

import json
from typing import Any, TypeAlias

JsonValue: TypeAlias = bool | int | str | list[Any] | dict[str, Any] | None

MAX_SAFE_INT = 2**53 - 1


class NotCanonical(ValueError):
    """The value is outside the hashable JSON subset."""


def check_json(value: object, path: str = "$") -> None:
    """Raise `NotCanonical` naming the first offending place if `value` is outside the subset."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
            raise NotCanonical(f"{path}: integer {value} outside ±(2**53 - 1)")
        return
    if isinstance(value, float):
        raise NotCanonical(f"{path}: floats are not allowed in ledger data ({value!r})")
    if isinstance(value, str):
        _check_text(value, path)
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_json(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise NotCanonical(f"{path}: object key {key!r} is not a string")
            _check_text(key, path)
            if any(ord(c) > 0xFFFF for c in key):
                raise NotCanonical(f"{path}: object key {key!r} is outside the BMP")
            check_json(item, f"{path}.{key}")
        return
    raise NotCanonical(f"{path}: {type(value).__name__} is not a JSON value")


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise NotCanonical(f"{path}: string holds a lone surrogate") from err


def canonical_bytes(value: object) -> bytes:
    """The canonical UTF-8 encoding of `value` (which must already pass `check_json`)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def canonicalize(value: object) -> bytes:
    """Check then encode: the one call for untrusted values."""
    check_json(value)
    return canonical_bytes(value)
