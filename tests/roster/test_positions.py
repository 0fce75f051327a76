"""The TOML position index: every key path maps to where its value starts."""

from __future__ import annotations

import tomllib
from typing import Any

import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from roster.positions import FieldPath, Position, PositionIndex, format_path

DOC = """\
# a comment with [brackets] and key = "value"
version = 1

[policy]
max_parallel = 4 # trailing comment
"quoted key" = 'lit'
budget.tokens = 10
  indented.deep.key   =   true

[[models]]
name = "tiny"
command = [
  "{python}",  # first
  '{port}',
  [1, 2],
]
sampling = { temperature = 0.5, seed = 7, nested = { k = "v" } }

[[models]]
name = \"\"\"multi
[lanes]
line\"\"\"
text = '''x = "y" '''

[models.sampling]
top_k = 40

[tiers]
ladder = ["cheap", "capable"]
cheap = ["tiny"]

[[fruits]]
name = "apple"
[[fruits.varieties]]
name = "red"
[[fruits.varieties]]
name = "green"
[[fruits]]
name = "pear"
[[fruits.varieties]]
name = "nashi"
[fruits.physical]
color = "green"
when = 1979-05-27 07:32:00Z
"""


def at(path: FieldPath, *, key: bool = False) -> tuple[int, int]:
    pos = PositionIndex(DOC).locate(path, key=key)
    return pos.line, pos.column


def test_the_fixture_is_valid_toml() -> None:
    tomllib.loads(DOC)


def test_top_level_and_table_values() -> None:
    assert at(("version",)) == (2, 11)
    assert at(("policy", "max_parallel")) == (5, 16)
    assert at(("policy", "max_parallel"), key=True) == (5, 1)
    assert at(("policy", "quoted key")) == (6, 16)
    assert at(("policy", "budget", "tokens")) == (7, 17)
    assert at(("policy", "indented", "deep", "key")) == (8, 27)


def test_array_of_tables_are_indexed() -> None:
    assert at(("models", 0, "name")) == (11, 8)
    assert at(("models", 1, "name")) == (20, 8)
    assert at(("models", 1, "text")) == (23, 8)
    assert at(("models", 1, "sampling", "top_k")) == (26, 9)


def test_inline_arrays_and_tables() -> None:
    assert at(("models", 0, "command")) == (12, 11)
    assert at(("models", 0, "command", 0)) == (13, 3)
    assert at(("models", 0, "command", 1)) == (14, 3)
    assert at(("models", 0, "command", 2, 1)) == (15, 7)
    assert at(("models", 0, "sampling", "seed")) == (17, 40)
    assert at(("models", 0, "sampling", "nested", "k")) == (17, 58)
    assert at(("tiers", "ladder", 1)) == (29, 20)


def test_nested_arrays_of_tables() -> None:
    assert at(("fruits", 0, "varieties", 1, "name")) == (37, 8)
    assert at(("fruits", 1, "name")) == (39, 8)
    assert at(("fruits", 1, "varieties", 0, "name")) == (41, 8)
    assert at(("fruits", 1, "physical", "color")) == (43, 9)
    assert at(("fruits", 1, "physical", "when")) == (44, 8)


def test_missing_paths_fall_back_to_the_enclosing_header() -> None:
    assert at(("models", 1, "slots")) == (19, 1)
    assert at(("models", 1, "sampling", "seed")) == (25, 1)
    assert at(("tiers", "capable")) == (28, 1)
    assert at(("nothing", "here")) == (1, 1)
    assert at(("models", 7)) == (10, 1)


def test_crlf_line_endings() -> None:
    text = "a = 1\r\n[t]\r\nb = 'x'\r\n"
    assert PositionIndex(text).locate(("t", "b")) == Position(3, 5)


def test_format_path() -> None:
    assert format_path(("lanes", 3, "tier")) == "lanes[3].tier"
    assert format_path(("tiers", "ladder", 1)) == "tiers.ladder[1]"
    assert format_path(("policy", "odd key")) == 'policy."odd key"'
    assert format_path(()) == ""


# -- property: on documents tomli-w writes, every leaf is found where its value starts ----

keys = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=6)
scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00\r"), max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(keys, inner, min_size=1, max_size=3)
    ),
    max_leaves=12,
)
documents = st.dictionaries(
    keys,
    st.one_of(values, st.lists(st.dictionaries(keys, values, max_size=3), min_size=1, max_size=3)),
    max_size=5,
)


def leaves(node: Any, path: FieldPath = ()) -> list[tuple[FieldPath, Any]]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in leaves(v, (*path, k))]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in leaves(v, (*path, i))]
    return [(path, node)]


FIRST = {bool: "tf", int: "-0123456789+", str: "\"'"}


@settings(max_examples=150, deadline=None)
@given(documents)
def test_every_leaf_is_located_at_its_value(data: dict[str, Any]) -> None:
    text = tomli_w.dumps(data, multiline_strings=True)
    assert tomllib.loads(text) == data
    index = PositionIndex(text)
    lines = text.split("\n")
    for path, value in leaves(data):
        assert path in index.values, (path, text)
        pos = index.values[path]
        char = lines[pos.line - 1][pos.column - 1]
        assert char in FIRST[type(value)], (path, value, pos, text)


def test_escaped_keys_and_unusual_spacing() -> None:
    text = '[ "t\\u0041" . sub ]\n"\\u0042" = 1\n[[ arr ]]\nx = 2\n'
    assert tomllib.loads(text) == {"tA": {"sub": {"B": 1}}, "arr": [{"x": 2}]}
    index = PositionIndex(text)
    assert index.locate(("tA", "sub", "B")) == Position(2, 12)
    assert index.locate(("arr", 0, "x")) == Position(4, 5)


def test_the_scanner_never_raises_on_what_it_cannot_follow() -> None:
    assert PositionIndex("a = [1,").locate(("a", 0)) == Position(1, 6)
