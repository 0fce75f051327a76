"""What product code writes to the ledger, seen from inside the tests that make it write.

Every append is checked by one function, `check_append` (the real ledger's and the engine's
in-memory test ledger's alike). `Watch` wraps it for the length of a test session and, for each
append whose writer is product code (the first frame outside `daemon/ledger/` lies in `daemon/`
or `surfaces/`, not in `tests/`), keeps the kind, the actor, the body's canonical bytes and the
writing line. Tests write arbitrary kinds of their own straight to the ledger; those are not
tally's vocabulary and are not kept.

Two uses:
- `tests/conftest.py` watches every session and fails a test whose product code wrote a kind
  `daemon.record` does not register (so a kind added later must register to pass).
- `pytest -p tests.record.corpus --record-corpus=FILE ...` appends what was written to FILE as
  JSON lines, a few distinct bodies per kind and shape: how `tests/record/corpus.jsonl`, the
  byte-for-byte corpus `tests/record/test_corpus.py` holds the models to, was made.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PER_SHAPE = 3  # distinct bodies kept per (kind, set of top-level keys)
MAX_BODY = 16384  # characters: the corpus stays small (a soak's 64 KiB outputs are not kept)


@dataclass
class Written:
    kind: str
    actor: str
    body: str | None  # canonical bytes as text; None for a body-less entry
    where: str  # path:line of the product code that wrote it
    parent: str | None = None  # its parent's kind, where the ledger could say (not recorded)


@dataclass
class Watch:
    """The appends product code made since the watch began."""

    written: list[Written] = field(default_factory=list)

    def wrap(self, check: Callable[..., bytes | None]) -> Callable[..., bytes | None]:
        def watched(**kwargs: Any) -> bytes | None:
            data = check(**kwargs)
            where = _product_caller()
            if where is not None:
                text = None if data is None else data.decode()
                self.written.append(Written(kwargs["kind"], kwargs["actor"], text, where))
            return data

        watched.__wrapped__ = check  # type: ignore[attr-defined]
        return watched

    def wrap_memory(self, append: Callable[..., Any]) -> Callable[..., Any]:
        """The engine's in-memory ledger knows every parent's kind: note it on the entry."""

        async def watched(ledger: Any, **kwargs: Any) -> Any:
            # `check_append` runs before the append's first await: no other append comes between
            at = len(self.written)
            entry = await append(ledger, **kwargs)
            parent = kwargs.get("parent")
            if parent is not None and len(self.written) > at:
                self.written[at].parent = ledger.log[parent].kind
            return entry

        watched.__wrapped__ = append  # type: ignore[attr-defined]
        return watched


@functools.cache
def _relative(path: str) -> str | None:
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None


def _product_caller() -> str | None:
    """The first product frame (not the ledger's) on the stack: a test's own witness helper
    that product code calls back (the agent loop's, say) writes what product code built."""
    frame = sys._getframe(2)
    while frame is not None:
        rel = _relative(frame.f_code.co_filename)
        product = rel is not None and rel.startswith(("daemon/", "surfaces/"))
        if product and not str(rel).startswith("daemon/ledger/"):
            return f"{rel}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def misfits(watch: Watch) -> list[str]:
    """What product code wrote that is not its kind's model, byte for byte (or no kind)."""
    from pydantic import ValidationError

    from daemon import record
    from daemon.ledger.canonical import canonicalize

    found: list[str] = []
    for item in watch.written:
        model = record.model_for(item.kind)
        if model is None:
            found.append(f"{item.where}: wrote {item.kind!r}, a kind daemon.record lacks")
            continue
        if item.body is None:
            found.append(f"{item.where}: wrote {item.kind!r} with no body")
            continue
        try:
            again = canonicalize(model.read(json.loads(item.body)).written()).decode()
        except (ValidationError, TypeError) as err:
            found.append(f"{item.where}: {item.kind} does not fit {model.__name__}: {err}")
            continue
        if again != item.body:
            found.append(f"{item.where}: {item.kind} changes when written as {model.__name__}")
        if item.parent is not None and item.parent not in model.PARENTS:
            found.append(
                f"{item.where}: {item.kind} hangs off a {item.parent}, not one of its kind's "
                f"parents {list(model.PARENTS)} (daemon.record)"
            )
    return found


def watching(monkeypatch: pytest.MonkeyPatch) -> Watch:
    """Start a watch for the length of `monkeypatch` (both places `check_append` is called)."""
    from daemon.ledger import writer

    watch = Watch()
    monkeypatch.setattr(writer, "check_append", watch.wrap(writer.check_append))
    try:
        from tests.runs import fakes
    except ImportError:  # pragma: no cover - the fake ledger is part of the suite
        return watch
    monkeypatch.setattr(fakes, "check_append", watch.wrap(fakes.check_append))  # type: ignore[attr-defined]
    monkeypatch.setattr(fakes.MemoryLedger, "append", watch.wrap_memory(fakes.MemoryLedger.append))
    return watch


def _portable(text: str | None) -> str | None:
    """The body with this machine's paths made neutral (the corpus is committed)."""
    if text is None:
        return None
    from daemon.ledger.canonical import canonicalize

    for venv in {Path(sys.prefix).resolve(), Path(sys.executable).parent.parent}:
        text = text.replace(str(venv), "/venv")
    text = text.replace(str(ROOT), "/repo")
    text = re.sub(r"/tmp/pytest-of-[^/\"]+/pytest-\d+/", "/tmp/pytest/", text)
    return canonicalize(json.loads(text)).decode()


def _shape(item: Written) -> tuple[str, str, tuple[str, ...]]:
    body = None if item.body is None else json.loads(item.body)
    keys = tuple(sorted(body)) if isinstance(body, dict) else (type(body).__name__,)
    return (item.kind, item.actor if item.actor in {"engine", "pool", "daemon"} else "", keys)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-corpus",
        default=None,
        help="append the bodies product code writes to this JSON-lines file (tests/record)",
    )


@pytest.fixture(autouse=True)
def _record_corpus(request: pytest.FixtureRequest) -> Iterator[None]:
    target = request.config.getoption("--record-corpus")
    if not target:
        yield
        return
    with pytest.MonkeyPatch.context() as monkeypatch:
        watch = watching(monkeypatch)
        yield
    path = Path(target)
    seen: dict[tuple[str, str, tuple[str, ...]], set[str | None]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            old = Written(**json.loads(line))
            seen.setdefault(_shape(old), set()).add(old.body)
    with path.open("a") as out:
        for item in watch.written:
            item.body = _portable(item.body)
            bodies = seen.setdefault(_shape(item), set())
            too_big = item.body is not None and len(item.body) > MAX_BODY
            if too_big or item.body in bodies or len(bodies) >= PER_SHAPE:
                continue
            bodies.add(item.body)
            kept = {k: v for k, v in item.__dict__.items() if k != "parent"}
            out.write(json.dumps(kept, sort_keys=True) + "\n")
