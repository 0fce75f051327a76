"""The edit format a chat task in a workspace answers in, parsed and applied to its view.

Modelled on aider's formats, parsed here (lenient where small models stray, strict where a
wrong guess would damage a file):
- whole file: the file's path on its own line (plain, `backticked`, **bold**, a `#` heading,
  or `File: path`), or in the fence's info string (```python path/to/x.py), then the complete
  content in a fenced block;
- search/replace: the path on its own line, then
  `<<<<<<< SEARCH` / old lines / `=======` / new lines / `>>>>>>> REPLACE`
  (an empty SEARCH creates the file or appends to an empty one);
- unified diff: a ```diff block with `--- a/path` / `+++ b/path` headers and `@@` hunks; each
  hunk is applied as a search/replace of its old lines by its new ones, so wrong line
  numbers do not matter.
An answer in prose only (no fence, no SEARCH block) changes no file. An answer with code but
no usable edit (a block without a path), or an edit that does not apply (a SEARCH not found,
a bad path), is an `EditError` whose message tells the model what to fix: the next attempt's
feedback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from daemon.workspace.paths import PathRefused, check_relative, is_hidden, join

MAX_EDITS = 200
MAX_FILE_CHARS = 1_000_000

INSTRUCTIONS = """Answer with the changes to make to the files, in one of these forms.
To write a whole file (new or replaced), put its path on its own line, then its complete \
content in a fenced code block:

path/to/file.py
```python
<the whole file>
```

To change part of a file, put its path on its own line, then one or more blocks:

path/to/file.py
<<<<<<< SEARCH
<lines copied exactly from the file>
=======
<the lines to put in their place>
>>>>>>> REPLACE

Paths are relative to the project root. Write complete code: no placeholders. If no file
needs to change, answer in prose without any code block."""


class EditError(ValueError):
    """The answer holds no usable edit, or one that cannot apply (the message says why)."""


@dataclass(frozen=True)
class Edit:
    path: str
    search: str | None
    """None: `replace` is the whole file."""
    replace: str


_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\n`]*)$")
_SEARCH = re.compile(r"^\s*<{5,9}\s*SEARCH\s*$")
_DIVIDER = re.compile(r"^\s*={5,9}\s*$")
_REPLACE = re.compile(r"^\s*>{5,9}\s*REPLACE\s*$")
_PATHLIKE = re.compile(r"^[\w.\-/+@]+$")


def _path_in(line: str) -> str | None:
    """A file path a line names on its own, if it does (decorations stripped)."""
    text = line.strip()
    for prefix in ("File:", "file:", "FILE:", "Path:", "path:", "Filename:", "filename:"):
        if text.startswith(prefix):
            text = text[len(prefix) :].strip()
    text = text.strip("#").strip().strip("*").strip("`").strip().rstrip(":").strip("`")
    if not text or " " in text or not _PATHLIKE.match(text):
        return None
    if "." not in text and "/" not in text and text not in ("Makefile", "Dockerfile"):
        return None
    return text


def _fence_path(info: str) -> str | None:
    for word in info.split():
        word = word.removeprefix("path=").removeprefix("file=").strip("\"'")
        if ("." in word or "/" in word) and _PATHLIKE.match(word):
            return word
    return None


def parse(answer: str) -> list[Edit]:
    """Every edit in the answer, in order; EditError when it holds none."""
    lines = answer.splitlines()
    edits: list[Edit] = []
    i = 0
    last_path: str | None = None
    while i < len(lines):
        line = lines[i]
        if _SEARCH.match(line):
            if last_path is None:
                raise EditError(
                    "a SEARCH/REPLACE block has no file path: put the path on its own line "
                    "just above `<<<<<<< SEARCH`"
                )
            i, edit = _search_block(lines, i, last_path)
            edits.append(edit)
            continue
        fence = _FENCE.match(line.strip())
        if fence:
            info = fence.group(2).strip()
            end = _closing(lines, i, fence.group(1))
            body = lines[i + 1 : end]
            if any(_SEARCH.match(b) for b in body):
                # SEARCH blocks inside a fence: the path may be the fence's or a line inside
                path = _fence_path(info) or last_path
                edits.extend(_blocks_in(body, path))
            elif info.split()[:1] in (["diff"], ["patch"], ["udiff"]) or _looks_unified(body):
                edits.extend(_unified(body))
            else:
                path = _fence_path(info) or last_path
                if path is not None:
                    edits.append(Edit(path=path, search=None, replace=_joined(body)))
                    last_path = None
            i = end + 1
            continue
        named = _path_in(line)
        if named is not None:
            last_path = named
        elif line.strip():
            last_path = last_path if _SEARCH.match(line) else None
        i += 1
    if not edits and not any(_FENCE.match(line.strip()) or _SEARCH.match(line) for line in lines):
        return []  # prose only: an answer that changes no file (the instructions allow it)
    if not edits:
        raise EditError(
            "no edit found in the answer. " + INSTRUCTIONS.split("\n", 1)[0] + " A whole file "
            "is its path on its own line followed by a fenced code block with all its content."
        )
    if len(edits) > MAX_EDITS:
        raise EditError(f"the answer holds {len(edits)} edits; at most {MAX_EDITS}")
    return edits


def _closing(lines: list[str], start: int, marker: str) -> int:
    for j in range(start + 1, len(lines)):
        if lines[j].strip() == marker or (
            lines[j].strip().startswith(marker[0] * 3) and not lines[j].strip().strip(marker[0])
        ):
            return j
    return len(lines)  # an unclosed fence runs to the end (a reply cut by max_tokens)


def _joined(body: list[str]) -> str:
    return "\n".join(body) + "\n" if body else ""


def _search_block(lines: list[str], start: int, path: str) -> tuple[int, Edit]:
    old: list[str] = []
    new: list[str] = []
    j = start + 1
    while j < len(lines) and not _DIVIDER.match(lines[j]):
        old.append(lines[j])
        j += 1
    if j >= len(lines):
        raise EditError(f"{path}: a SEARCH block without its `=======` line")
    j += 1
    while j < len(lines) and not _REPLACE.match(lines[j]):
        new.append(lines[j])
        j += 1
    if j >= len(lines):
        raise EditError(f"{path}: a SEARCH block without its `>>>>>>> REPLACE` line")
    return j + 1, Edit(path=path, search=_joined(old), replace=_joined(new))


def _blocks_in(body: list[str], path: str | None) -> list[Edit]:
    found: list[Edit] = []
    i = 0
    while i < len(body):
        named = _path_in(body[i])
        if named is not None:
            path = named
        if _SEARCH.match(body[i]):
            if path is None:
                raise EditError(
                    "a SEARCH/REPLACE block has no file path: put the path on its own line "
                    "just above `<<<<<<< SEARCH`"
                )
            i, edit = _search_block(body, i, path)
            found.append(edit)
            continue
        i += 1
    return found


def _looks_unified(body: list[str]) -> bool:
    return any(b.startswith("--- ") for b in body) and any(b.startswith("+++ ") for b in body)


def _unified(body: list[str]) -> list[Edit]:
    edits: list[Edit] = []
    path: str | None = None
    created = False
    old: list[str] = []
    new: list[str] = []

    def flush() -> None:
        if path is None or (not old and not new):
            return
        if created:
            edits.append(Edit(path=path, search=None, replace=_joined(new)))
        else:
            edits.append(Edit(path=path, search=_joined(old), replace=_joined(new)))

    for line in body:
        if line.startswith("--- "):
            flush()
            old, new = [], []
            source = line[4:].split("\t")[0].strip()
            created = source == "/dev/null"
            continue
        if line.startswith("+++ "):
            target = line[4:].split("\t")[0].strip()
            path = target[2:] if target[:2] in ("a/", "b/") else target
            continue
        if line.startswith("@@"):
            if not created:
                flush()
                old, new = [], []
            continue
        if line.startswith(("diff --git", "index ")):
            continue
        if line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
        elif line.startswith(" ") or not line:
            old.append(line[1:])
            new.append(line[1:])
    flush()
    if not edits:
        raise EditError("the diff block holds no hunk: give `--- a/path`, `+++ b/path`, `@@`")
    return edits


def apply(view: Path, edits: list[Edit], hide: list[str]) -> list[str]:
    """Apply the edits to the view; the paths changed, in order. Nothing is written through
    a symlink, outside the view, or to a hidden path."""
    changed: dict[str, None] = {}
    for edit in edits:
        try:
            rel = check_relative(edit.path)
            target = join(view, rel)
        except PathRefused as exc:
            raise EditError(f"refused edit: {exc}") from None
        if is_hidden(rel, hide):
            raise EditError(f"refused edit: {rel!r} is a hidden path tasks may not write")
        if edit.search is None:
            content = edit.replace
        else:
            current = target.read_text(errors="replace") if target.is_file() else None
            content = _replaced(rel, current, edit.search, edit.replace)
        if len(content) > MAX_FILE_CHARS:
            raise EditError(f"{rel}: {len(content)} characters; at most {MAX_FILE_CHARS}")
        if target.is_dir():
            raise EditError(f"{rel}: is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        changed.setdefault(rel, None)
    return list(changed)


def _replaced(path: str, current: str | None, search: str, replace: str) -> str:
    if current is None:
        if search.strip():
            raise EditError(f"{path}: no such file to search in (to create it, write it whole)")
        return replace
    if not search.strip():
        if current.strip():
            raise EditError(
                f"{path}: an empty SEARCH only creates a file; copy the lines to "
                "replace into SEARCH"
            )
        return replace
    if search in current:
        return current.replace(search, replace, 1)
    # Lenient: the same lines with different trailing spaces or indentation widths.
    flexible = _flexible(current, search, replace)
    if flexible is not None:
        return flexible
    first = next((line for line in search.splitlines() if line.strip()), "")
    raise EditError(
        f"{path}: the SEARCH lines are not in the file (first: {first.strip()[:120]!r}); "
        "copy them exactly from the file as it is"
    )


def _flexible(current: str, search: str, replace: str) -> str | None:
    lines = current.splitlines(keepends=True)
    wanted = [line.strip() for line in search.splitlines()]
    while wanted and not wanted[-1]:
        wanted.pop()
    while wanted and not wanted[0]:
        wanted.pop(0)
    if not wanted:
        return None
    for start in range(len(lines) - len(wanted) + 1):
        if all(lines[start + n].strip() == wanted[n] for n in range(len(wanted))):
            end = start + len(wanted)
            return "".join(lines[:start]) + replace + "".join(lines[end:])
    return None
