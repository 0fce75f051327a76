"""Where a value sits in a TOML document: field path -> line and column.

`tomllib` parses but keeps no positions, so error messages about values would have nothing
to point at. This scanner walks a document that `tomllib` has already accepted (so it may
assume valid TOML) and records, for every key path, the position of the key and of its
value: `[table]` and `[[array]]` headers (with the array's running index), dotted keys,
inline tables and arrays. A path that is not in the document (a missing field) resolves to
its nearest enclosing key or header.
"""

from __future__ import annotations

import bisect
import contextlib
import re
from dataclasses import dataclass

FieldPath = tuple[str | int, ...]

_BARE = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}
_SCALAR_END = frozenset(",]}#\n")


@dataclass(frozen=True, order=True)
class Position:
    """1-based line and column (in characters), counted as tomllib counts them."""

    line: int
    column: int


def format_path(path: FieldPath) -> str:
    """`("lanes", 3, "tier")` -> `lanes[3].tier`; keys that are not bare are quoted."""
    out: list[str] = []
    for part in path:
        if isinstance(part, int):
            out.append(f"[{part}]")
            continue
        key = part if _BARE.fullmatch(part) else '"' + part.replace('"', '\\"') + '"'
        out.append(f".{key}" if out else key)
    return "".join(out)


class PositionIndex:
    """Positions of every key and value in one TOML document."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self.values: dict[FieldPath, Position] = {}
        self.keys: dict[FieldPath, Position] = {}
        self._array_tables: dict[FieldPath, int] = {}
        # On a construct this scanner does not follow, keep what it found: lookups of the
        # rest fall back to enclosing paths. Locating errors must never raise.
        with contextlib.suppress(ValueError, IndexError):
            self._scan()

    def locate(self, path: FieldPath, *, key: bool = False) -> Position:
        """The value's position (or the key's), else that of the nearest enclosing path."""
        first, second = (self.keys, self.values) if key else (self.values, self.keys)
        probe = tuple(path)
        while probe:
            found = first.get(probe) or second.get(probe)
            if found is not None:
                return found
            probe = probe[:-1]
        return Position(1, 1)

    def span(self, path: FieldPath) -> tuple[int, int] | None:
        """Character offsets `[start, end)` of the value at `path`, or None if it is absent."""
        where = self.values.get(path)
        if where is None:
            return None
        start = self._line_starts[where.line - 1] + where.column - 1
        try:
            return start, self._value(start, path)
        except (ValueError, IndexError):
            return None

    # -- scanning -------------------------------------------------------------------------

    def _pos(self, offset: int) -> Position:
        line = bisect.bisect_right(self._line_starts, offset)
        return Position(line, offset - self._line_starts[line - 1] + 1)

    def _scan(self) -> None:
        text = self._text
        i = 0
        table: FieldPath = ()
        while True:
            i = self._skip_blank(i, newlines=True)
            if i >= len(text):
                return
            if text.startswith("[[", i):
                table, i = self._header(i + 2, array=True)
            elif text[i] == "[":
                table, i = self._header(i + 1, array=False)
            else:
                i = self._key_value(i, table)

    def _header(self, i: int, *, array: bool) -> tuple[FieldPath, int]:
        start = i - (2 if array else 1)
        parts, i = self._key(self._skip_blank(i))
        i = self._skip_blank(i)
        i += 2 if array else 1  # the closing bracket(s)
        where = self._pos(start)
        resolved: FieldPath = ()
        for n, (name, _) in enumerate(parts):
            resolved = (*resolved, name)
            last = n == len(parts) - 1
            if last and array:
                index = self._array_tables.get(resolved, 0)
                self._array_tables[resolved] = index + 1
                self._mark(resolved, where, None)  # the array itself: its first header
                resolved = (*resolved, index)
            elif resolved in self._array_tables:
                resolved = (*resolved, self._array_tables[resolved] - 1)
        self._mark(resolved, where, where)
        return resolved, i

    def _key_value(self, i: int, table: FieldPath) -> int:
        parts, i = self._key(i)
        path = table
        for name, offset in parts:
            path = (*path, name)
            self._mark(path, self._pos(offset), None)
        i = self._skip_blank(i)
        i = self._skip_blank(i + 1)  # past "="
        return self._value(i, path)

    def _mark(self, path: FieldPath, key: Position, value: Position | None) -> None:
        self.keys.setdefault(path, key)
        if value is not None:
            self.values[path] = value

    def _key(self, i: int) -> tuple[list[tuple[str, int]], int]:
        """A dotted key: its parts with their offsets."""
        text = self._text
        parts: list[tuple[str, int]] = []
        while True:
            start = i
            if text[i] == '"':
                name, i = self._basic_string(i)
            elif text[i] == "'":
                end = text.index("'", i + 1)
                name, i = text[i + 1 : end], end + 1
            else:
                match = _BARE.match(text, i)
                if match is None:
                    raise ValueError(f"not a key at {self._pos(i)}")
                name, i = match.group(), match.end()
            parts.append((name, start))
            j = self._skip_blank(i)
            if j < len(text) and text[j] == ".":
                i = self._skip_blank(j + 1)
                continue
            return parts, i

    def _value(self, i: int, path: FieldPath) -> int:
        text = self._text
        self.values[path] = self._pos(i)
        if text.startswith('"""', i):
            return self._multiline(i, '"""', escapes=True)
        if text.startswith("'''", i):
            return self._multiline(i, "'''", escapes=False)
        char = text[i]
        if char == '"':
            return self._basic_string(i)[1]
        if char == "'":
            return text.index("'", i + 1) + 1
        if char == "[":
            return self._array(i + 1, path)
        if char == "{":
            return self._inline_table(i + 1, path)
        while i < len(text) and text[i] not in _SCALAR_END:
            i += 1
        return i

    def _array(self, i: int, path: FieldPath) -> int:
        text = self._text
        index = 0
        while True:
            i = self._skip_blank(i, newlines=True)
            if text[i] == "]":
                return i + 1
            i = self._value(i, (*path, index))
            index += 1
            i = self._skip_blank(i, newlines=True)
            if text[i] == ",":
                i += 1

    def _inline_table(self, i: int, path: FieldPath) -> int:
        text = self._text
        while True:
            i = self._skip_blank(i, newlines=True)
            if text[i] == "}":
                return i + 1
            i = self._key_value(i, path)
            i = self._skip_blank(i, newlines=True)
            if text[i] == ",":
                i += 1

    def _basic_string(self, i: int) -> tuple[str, int]:
        """A one-line basic string starting at the quote: its decoded text and end offset."""
        text = self._text
        out: list[str] = []
        i += 1
        while text[i] != '"':
            if text[i] != "\\":
                out.append(text[i])
                i += 1
                continue
            code = text[i + 1]
            if code in _ESCAPES:
                out.append(_ESCAPES[code])
                i += 2
            else:
                width = 4 if code == "u" else 8
                out.append(chr(int(text[i + 2 : i + 2 + width], 16)))
                i += 2 + width
        return "".join(out), i + 1

    def _multiline(self, i: int, quotes: str, *, escapes: bool) -> int:
        text = self._text
        i += 3
        while not text.startswith(quotes, i):
            i += 2 if escapes and text[i] == "\\" else 1
        i += 3
        # Up to two more quote characters may close the string as part of its content.
        for _ in range(2):
            if i < len(text) and text[i] == quotes[0]:
                i += 1
        return i

    def _skip_blank(self, i: int, *, newlines: bool = False) -> int:
        """Past spaces and tabs, and with `newlines` also past line breaks and comments."""
        text = self._text
        while i < len(text):
            char = text[i]
            if char in " \t" or (newlines and char in "\r\n"):
                i += 1
            elif char == "#" and newlines:
                end = text.find("\n", i)
                i = len(text) if end < 0 else end
            else:
                break
        return i
