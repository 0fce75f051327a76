"""daemon.intake: untrusted JSON is parsed with bounded nesting, never a RecursionError."""

from __future__ import annotations

import json

import pytest

from daemon.intake import MAX_DEPTH, MAX_VALUES, Malformed, depth, loads
from daemon.runs.guard import parse_json


def test_nesting_at_the_bound_parses_and_one_more_is_refused() -> None:
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    with pytest.raises(Malformed, match="nests deeper than 64"):
        loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"code": "[" * 5000 + "{" * 5000, "quote": '\\"[[[', "list": [[1]]})
    assert depth(text.encode()) == 3
    assert loads(text)["list"] == [[1]]


def test_100k_deep_is_malformed_not_a_recursion_error() -> None:
    for text in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        with pytest.raises(Malformed):
            loads(text)


@pytest.mark.parametrize("text", ["NaN", '{"x": Infinity}', "[-Infinity]", '{"a": 1', "\xff"])
def test_what_no_ledger_holds_or_no_parser_reads_is_malformed(text: str) -> None:
    with pytest.raises(Malformed):
        loads(text.encode("latin-1"))


def test_a_model_reply_nested_past_the_limit_is_no_json_not_a_crash() -> None:
    with pytest.raises(ValueError, match="no JSON object"):
        parse_json("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("unit", [b"[]", b"{}", b'""', b"0.5", b'{"":0}'])
def test_a_body_small_in_bytes_but_many_values_is_malformed(unit: bytes) -> None:
    # 1M + 1 tiny values: a few MiB of text, hundreds of MB once parsed
    with pytest.raises(Malformed, match="more than 1048576 JSON values"):
        loads(b"[" + b",".join([unit] * (MAX_VALUES + 1)) + b"]")


def test_values_at_the_bound_and_commas_inside_strings_parse() -> None:
    assert len(loads(b"[" + b",".join([b"1"] * (MAX_VALUES - 1)) + b"]")) == MAX_VALUES - 1
    prose = json.dumps({"content": 'a, [b], {c}, \\" ' * 300_000})
    assert loads(prose)["content"].startswith("a, [b]")
