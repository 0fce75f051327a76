"""The canonical form of a chunk of entry lines, checked in bulk for deep verify.

One RE2 pattern, linear in the chunk, holds every line against the exact bytes `Entry.line()`
writes; the seqs are read from the chunk in one pass. RE2 releases the GIL while it matches, so
for a big chunk `FormCheck` runs on a thread of its own: the match overlaps the chunk's leaf
hashing on the verifying thread, which holds the GIL.
"""

from __future__ import annotations

import re
import threading

import re2

THREAD_MIN_LINES = 4096  # below this a thread costs more than the match it overlaps


def _canonical_entries() -> re2._Regexp:
    """Lines of canonical entries, each ending in a newline: the exact bytes `Entry.line()`
    writes for valid fields, nothing else. Strings hold only what the canonical encoder leaves
    raw (any byte from 0x20 but `"` and `\\`) or its own escapes; numbers have no leading
    zeros and stay below 9 * 10**15 (< 2**53: larger, rarer ones are left to the parser).
    RE2 runs in time linear in the chunk, with no backtracking; bytes are matched as Latin-1
    and UTF-8 is checked on its own."""
    char = rb'(?:[^"\\\x00-\x1f]|\\(?:["\\bfnrt]|u00(?:0[0-7bef]|1[0-9a-f])))'
    number = rb"(?:0|[1-9][0-9]{0,14}|[1-8][0-9]{15})"
    line = (
        rb'\{"actor":"' + char + rb'+","body":(?:null|"[0-9a-f]{64}"),"kind":"' + char + rb'+",'
        rb'"parent":(?:null|' + number + rb'),"prev":"[0-9a-f]{64}",'
        rb'"run":(?:null|"' + char + rb'*"),"seq":' + number + rb',"ts":' + number + rb',"v":1\}'
    )
    options = re2.Options()
    options.encoding = re2.Options.Encoding.LATIN1
    options.max_mem = 64 << 20
    options.log_errors = False
    return re2.compile(rb"(?:" + line + rb"\n)*", options)


CANONICAL = _canonical_entries()
# In a canonical line a quote inside a string is escaped, so these keys occur once, as keys.
_SEQ = re.compile(rb'"seq":([0-9]+)')
REDACTION = b'"kind":"redaction"'


class FormCheck:
    """Whether a chunk (the lines of entries `seq`, `seq` + 1, ...) is canonical, with those
    seqs, and whether any line may be a `redaction` entry; started at once, read by `result`."""

    def __init__(self, seq: int, lines: list[bytes]) -> None:
        self.seq = seq
        self.lines = lines
        self.ok = False
        self.redaction = False
        self.thread: threading.Thread | None = None
        if len(lines) >= THREAD_MIN_LINES:
            self.thread = threading.Thread(target=self._check, name="entry-form", daemon=True)
            self.thread.start()
        else:
            self._check()

    def _check(self) -> None:
        block = b"\n".join(self.lines) + b"\n"
        if not block.isascii():
            try:
                block.decode("utf-8")
            except UnicodeDecodeError:
                return
        if CANONICAL.fullmatch(block) is None:
            return
        seqs = _SEQ.findall(block)
        self.redaction = REDACTION in block
        self.ok = list(map(int, seqs)) == list(range(self.seq, self.seq + len(self.lines)))

    def result(self) -> tuple[bool, bool]:
        """(canonical with the right seqs, a line names `"kind":"redaction"`)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return self.ok, self.redaction
