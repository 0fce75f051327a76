from __future__ import annotations

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from daemon.ledger.canonical import (
    MAX_SAFE_INT,
    NotCanonical,
    canonical_bytes,
    canonicalize,
    stdlib_bytes,
)
from daemon.ledger.entry import GENESIS_PREV, Entry, encode_line

bmp_text = st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=["Cs"]))
any_text = st.text(st.characters(exclude_categories=["Cs"]))
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-MAX_SAFE_INT, max_value=MAX_SAFE_INT)
    | any_text
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(bmp_text, inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300)
@given(values)
def test_stdlib_encoding_equals_rfc8785(value: object) -> None:
    assert canonicalize(value) == rfc8785.dumps(value)  # type: ignore[arg-type]


@settings(max_examples=300)
@given(values)
def test_the_two_encoders_write_the_same_bytes(value: object) -> None:
    assert canonical_bytes(value) == stdlib_bytes(value)


def test_nesting_past_the_fast_encoders_limit_is_still_canonical() -> None:
    value: object = "leaf"
    for depth in range(400):  # orjson stops at 255 levels; the stdlib encoder takes over
        value = [value] if depth % 2 else {"k": value}
    assert canonicalize(value) == rfc8785.dumps(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        1.0,
        float("nan"),
        2**53,
        -(2**53),
        {"a": [0.5]},
        {"\U0001f600": 1},
        "\ud800",
        {"\udfff": 1},
        ["ok", {"a": "\ud800"}],
        {1: 2},
        (1,),
    ],
)
def test_refuses_values_outside_the_subset(bad: object) -> None:
    with pytest.raises(NotCanonical):
        canonicalize(bad)


def test_entry_line_round_trip_and_identity() -> None:
    line = encode_line(
        seq=0, ts=1, actor="ä", kind="note", run=None, parent=None, body=None, prev=GENESIS_PREV
    )
    entry = Entry.from_line(line)
    assert entry.line() == line
    assert entry.hash == Entry.from_line(line).hash
    assert b'"actor":"\xc3\xa4"' in line  # raw UTF-8, not \u escapes
    assert line == canonical_bytes(entry.model_dump())


def test_entry_model_refuses_floats_and_big_ints() -> None:
    base = {
        "seq": 0,
        "ts": 1,
        "actor": "a",
        "kind": "k",
        "prev": GENESIS_PREV,
        "hash": GENESIS_PREV,
    }
    with pytest.raises(ValidationError):
        Entry.model_validate({**base, "ts": 1.0})
    with pytest.raises(ValidationError):
        Entry.model_validate({**base, "seq": 2**53})
    with pytest.raises(ValueError):
        Entry.from_line(b'{"actor":"a", "body":null}')


@settings(max_examples=300)
@given(
    any_text.filter(bool),
    any_text.filter(bool),
    st.none() | any_text,
    st.none() | st.integers(0, MAX_SAFE_INT),
    st.integers(0, MAX_SAFE_INT),
)
def test_fast_line_encoder_equals_canonical(
    actor: str, kind: str, run: str | None, parent: int | None, seq: int
) -> None:
    fields = {
        "v": 1,
        "seq": seq,
        "ts": seq,
        "actor": actor,
        "kind": kind,
        "run": run,
        "parent": parent,
        "body": GENESIS_PREV,
        "prev": GENESIS_PREV,
    }
    line = encode_line(
        seq=seq,
        ts=seq,
        actor=actor,
        kind=kind,
        run=run,
        parent=parent,
        body=GENESIS_PREV,
        prev=GENESIS_PREV,
    )
    assert line == canonical_bytes(fields) == rfc8785.dumps(fields)  # type: ignore[arg-type]
