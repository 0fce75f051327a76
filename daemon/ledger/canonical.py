"""Canonical JSON for hashed ledger data.

Hashed data is restricted to a JSON subset on which the encoders below are byte-equal to
RFC 8785 (JCS): null, bool, str, int with |n| <= 2**53 - 1, list and dict with str keys. Floats
are refused (JCS and Python format them differently), as are lone surrogates (not UTF-8
encodable) and object keys outside the Basic Multilingual Plane (JCS orders keys by UTF-16 code
units, Python by code points and orjson by UTF-8 bytes; the orders only differ for such keys).

Two encoders write the same bytes on the subset (the hypothesis test against `rfc8785` holds
both to it): orjson with sorted keys, at about a tenth of the cost, and the stdlib's, which
decides whatever orjson refuses (it stops at 255 levels of nesting, where the subset has no
limit).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring as _encode_basestring
from typing import Any, TypeAlias, cast, overload

import orjson

JsonValue: TypeAlias = bool | int | str | list[Any] | dict[str, Any] | None

MAX_SAFE_INT = 2**53 - 1


class NotCanonical(ValueError):
    """The value is outside the hashable JSON subset."""


def check_json(value: object, path: str = "$") -> None:
    """Raise `NotCanonical` naming the first offending place if `value` is outside the subset.

    Dispatches on exact types (the append hot path); string contents are checked by
    `canonicalize`, whose UTF-8 encode fails on lone surrogates.
    """
    t = type(value)
    if t is str or t is bool or value is None:
        return
    if t is int:
        if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:  # type: ignore[operator]
            raise NotCanonical(f"{path}: integer {value} outside ±(2**53 - 1)")
        return
    if t is list:
        for i, item in enumerate(cast("list[Any]", value)):
            u = type(item)
            if u is str or u is bool or item is None:
                continue
            if u is int and -MAX_SAFE_INT <= item <= MAX_SAFE_INT:
                continue
            check_json(item, f"{path}[{i}]")
        return
    if t is dict:
        for key, item in cast("dict[Any, Any]", value).items():
            if type(key) is not str:
                raise NotCanonical(f"{path}: object key {key!r} is not a string")
            if not key.isascii() and any(ord(c) > 0xFFFF for c in key):
                raise NotCanonical(f"{path}: object key {key!r} is outside the BMP")
            u = type(item)
            if u is str or u is bool or item is None:
                continue
            if u is int and -MAX_SAFE_INT <= item <= MAX_SAFE_INT:
                continue
            check_json(item, f"{path}.{key}")
        return
    if isinstance(value, float):
        raise NotCanonical(f"{path}: floats are not allowed in ledger data ({value!r})")
    raise NotCanonical(f"{path}: {t.__name__} is not a JSON value (only exact JSON types)")


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise NotCanonical(f"{path}: string holds a lone surrogate") from err


def _not_json(value: object) -> object:
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _make_encoder() -> Callable[[object, int], Any] | None:
    """The stdlib's C encoder, configured once as `json.dumps` would per call.

    Same arguments as `JSONEncoder.iterencode` passes it for `sort_keys=True,
    separators=(",", ":"), ensure_ascii=False, allow_nan=False`, so the output is identical;
    building it once saves most of `json.dumps`' cost on small bodies. No circular-reference
    markers: `check_json` has already walked the value (a cycle fails there).
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    return cast(
        "Callable[[object, int], Any]",
        make(None, _not_json, _encode_basestring, None, ":", ",", True, False, False),
    )


_ENCODE = _make_encoder()


def canonical_bytes(value: object) -> bytes:
    """The canonical UTF-8 encoding of `value`, which must already pass `check_json` (outside
    the subset the bytes are not canonical: orjson writes floats its own way)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return stdlib_bytes(value)


def stdlib_bytes(value: object) -> bytes:
    """`canonical_bytes` by the stdlib's encoder (raises UnicodeEncodeError on a lone
    surrogate)."""
    if _ENCODE is None:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    return "".join(_ENCODE(value, 0)).encode("utf-8")


def canonicalize(value: object) -> bytes:
    """Check then encode: the one call for untrusted values."""
    try:
        check_json(value)
    except RecursionError as err:
        raise NotCanonical("the value is nested too deeply (or refers to itself)") from err
    try:
        return canonical_bytes(value)
    except UnicodeEncodeError as err:
        raise NotCanonical("a string holds a lone surrogate") from err


def check_text(text: str) -> None:
    """A str field of an entry: it must be UTF-8 encodable."""
    _check_text(text, "$")


@overload
def safe(value: dict[str, Any]) -> dict[str, Any]: ...
@overload
def safe(value: object) -> object: ...
def safe(value: object) -> object:
    """Make a value given from outside ledger-safe: each float becomes {"__float__": "<repr>"}
    (reversed by `unsafe`). The record's bodies pass a plan's `timeout_s` or a request's
    sampling parameters through it; hashed data itself holds no floats (module doc)."""
    if isinstance(value, float):
        return {"__float__": repr(value)}
    if isinstance(value, dict):
        return {str(key): safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [safe(item) for item in value]
    return value


def unsafe(value: object) -> object:
    """Undo `safe`."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {key: unsafe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [unsafe(item) for item in value]
    return value
