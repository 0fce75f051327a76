"""What a chat task in a workspace is shown: a file listing and the files its instruction
names, within its member's context window, with every cut said in the prompt.

The room is counted in characters (`CHARS_PER_TOKEN` per token, a cautious average for code)
from the member's context window less the answer's tokens and the rest of the prompt. The
listing comes first (cut to `LISTING_MAX` paths), then each named file whole while it fits,
the first that does not fit cut with a note, and the names of those left out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CHARS_PER_TOKEN = 3
LISTING_MAX = 400
BINARY_SNIFF = 8000  # git's own look for a NUL byte
_WORD = re.compile(r"[\w.\-/]+")


def files_of(root: Path) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            found.append(name if rel == "." else f"{rel}/{name}")
    return found


def named(instruction: str, files: list[str]) -> list[str]:
    """The files an instruction names, by path or by a file name that is unique."""
    words = {w.strip(".,:;()'\"`") for w in _WORD.findall(instruction)}
    by_name: dict[str, list[str]] = {}
    for path in files:
        by_name.setdefault(path.rsplit("/", 1)[-1], []).append(path)
    chosen: dict[str, None] = {}
    for path in files:
        if path in words:
            chosen.setdefault(path, None)
    for word in words:
        if word in by_name and len(by_name[word]) == 1:
            chosen.setdefault(by_name[word][0], None)
    return list(chosen)


def block(root: Path, instruction: str, room_chars: int) -> str:
    """The workspace part of the prompt, at most about `room_chars` characters."""
    files = files_of(root)
    parts: list[str] = []
    shown = files[:LISTING_MAX]
    listing = "\n".join(shown) or "(no files)"
    note = (
        f"\n(listing cut: {len(shown)} of {len(files)} files shown)"
        if len(files) > len(shown)
        else ""
    )
    head = f"The project's files ({len(files)}):\n{listing}{note}"
    if len(head) > room_chars:
        head = head[: max(0, room_chars - 60)] + "\n(listing cut to fit the context window)"
    parts.append(head)
    room = room_chars - len(head)
    left_out: list[str] = []
    binary: list[str] = []
    for path in named(instruction, files):
        try:
            data = (root / path).read_bytes()
        except OSError:
            continue
        if b"\0" in data[:BINARY_SNIFF]:  # as git tells a binary file: shown, it is noise
            binary.append(path)
            continue
        text = data.decode("utf-8", errors="replace")
        framed = f"{path}\n```\n{text}\n```"
        if len(framed) <= room:
            parts.append(framed)
            room -= len(framed)
        elif room > 400:
            keep = room - 200
            parts.append(
                f"{path} (cut: its first {keep} of {len(text)} characters, to fit the "
                f"context window)\n```\n{text[:keep]}\n```"
            )
            room = 0
        else:
            left_out.append(path)
    if binary:
        parts.append("Not shown, binary files: " + ", ".join(binary[:50]))
    if left_out:
        parts.append(
            "Not shown for lack of room in the context window: " + ", ".join(left_out[:50])
        )
    return "\n\n".join(parts)
