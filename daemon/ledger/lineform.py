"""The canonical form of a chunk of entry lines, checked in bulk for deep verify.

One RE2 pattern, linear in the chunk, holds every line against the exact bytes `Entry.line()`
writes (a twin of it, matched first, also says that no line is a `redaction` entry, so the
usual chunk needs no other pass to tell); the seqs are read from the chunk in one pass. RE2
releases the GIL while it matches, so for a big chunk `FormCheck` runs on a kept thread: the
match overlaps the chunk's leaf hashing on the verifying thread, which holds the GIL.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor

import re2

log = logging.getLogger(__name__)

THREAD_MIN_LINES = 4096  # below this a thread costs more than the match it overlaps


_ESCAPE = rb'\\(?:["\\bfnrt]|u00(?:0[0-7bef]|1[0-9a-f]))'


def _char(but: bytes = b"") -> bytes:
    """One character of a canonical string (raw, or the canonical encoder's own escape), other
    than the raw byte `but` (an escape is never a letter)."""
    return rb'(?:[^"\\\x00-\x1f' + but + rb"]|" + _ESCAPE + rb")"


def _other_than(word: bytes) -> bytes:
    """A non-empty canonical string other than `word` (letters only): it differs from `word`
    at some place, or is a proper prefix of it, or goes on past it. RE2 has no lookahead, so
    the complement is spelled out; `word` has one canonical spelling (letters are never
    escaped), so this is exact."""
    char = _char()
    forms = [word[:i] + _char(word[i : i + 1]) + char + b"*" for i in range(len(word))]
    forms += [word[:i] for i in range(1, len(word))]
    forms.append(word + char + b"+")
    return b"(?:" + b"|".join(forms) + b")"


def _canonical_entries(kind: bytes) -> re2._Regexp:
    """Lines of canonical entries whose kind matches `kind`, each ending in a newline: the
    exact bytes `Entry.line()` writes for valid fields, nothing else. Strings hold only what
    the canonical encoder leaves raw (any byte from 0x20 but `"` and `\\`) or its own escapes;
    numbers have no leading zeros and stay below 9 * 10**15 (< 2**53: larger, rarer ones are
    left to the parser). RE2 runs in time linear in the chunk, with no backtracking; bytes are
    matched as Latin-1 and UTF-8 is checked on its own."""
    char = _char()
    number = rb"(?:0|[1-9][0-9]{0,14}|[1-8][0-9]{15})"
    line = (
        rb'\{"actor":"' + char + rb'+","body":(?:null|"[0-9a-f]{64}"),"kind":"' + kind + rb'",'
        rb'"parent":(?:null|' + number + rb'),"prev":"[0-9a-f]{64}",'
        rb'"run":(?:null|"' + char + rb'*"),"seq":' + number + rb',"ts":' + number + rb',"v":1\}'
    )
    options = re2.Options()
    options.encoding = re2.Options.Encoding.LATIN1
    options.max_mem = 64 << 20
    options.log_errors = False
    return re2.compile(rb"(?:" + line + rb"\n)*", options)


CANONICAL = _canonical_entries(_char() + b"+")
PLAIN = _canonical_entries(_other_than(b"redaction"))
"""`CANONICAL` with no `redaction` entry: a chunk it matches needs no look for witnesses."""
# In a canonical line a quote inside a string is escaped, so this key occurs once, as a key.
_SEQ = re.compile(rb'"seq":([0-9]+)')
REDACTION = b'"kind":"redaction"'


# Threads kept for the checks (two: verifies may overlap; started by the first submit):
# starting a thread per chunk waits for it to be scheduled, milliseconds on a busy machine.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="entry-form")


class FormCheck:
    """Whether a chunk (the lines of entries `seq`, `seq` + 1, ...) is canonical, with those
    seqs, and whether any line is a `redaction` entry; started at once, read by `result`."""

    def __init__(self, seq: int, lines: list[bytes]) -> None:
        self.seq = seq
        self.lines = lines
        self.ok = False
        self.redaction = False
        self.future: Future[None] | None = None
        if len(lines) >= THREAD_MIN_LINES:
            self.future = _POOL.submit(self._check)
        else:
            self._check()

    def _check(self) -> None:
        block = b"\n".join([*self.lines, b""])  # each line with its newline, in one copy
        if not block.isascii():
            try:
                block.decode("utf-8")
            except UnicodeDecodeError:
                return
        if PLAIN.fullmatch(block) is None:
            if CANONICAL.fullmatch(block) is None:
                return
            self.redaction = True  # canonical, so some line's kind is exactly `redaction`
        seqs = _SEQ.findall(block)
        self.ok = list(map(int, seqs)) == list(range(self.seq, self.seq + len(self.lines)))

    def result(self) -> tuple[bool, bool]:
        """(canonical with the right seqs, some line is a `redaction` entry). A check that
        failed to run says "not canonical": the chunk is then walked entry by entry."""
        if self.future is not None:
            future, self.future = self.future, None
            if (err := future.exception()) is not None:
                log.warning("ledger: the canonical-form check failed (%r); walking the chunk", err)
                self.ok = False
        return self.ok, self.redaction
