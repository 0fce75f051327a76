"""Who calls the daemon: named clients, each with one scope, known by a hashed bearer token.

Scopes form a ladder, each including the ones below it:
- `read`: read-only tools (runs, ledger, roster, pool, proofs, metrics);
- `submit`: runs whose plan has no command task, cancel, resume;
- `command`: runs that use the command executor;
- `admin`: roster reload, redaction, checkpoint signing, client management.

The unix-socket owner is `admin` (the socket is 0600: only the daemon's user reaches it). The
legacy `<state>/http.token` is the client named `default` with every scope, so setups from
before named clients keep working. Other clients live in `<state>/clients.json` (0600, written
atomically) as sha256 digests of their tokens: the file never holds a usable secret, and a
token is shown once, when it is made. The store re-reads the file when it changes (a new inode
per write, so two writes in one clock tick are still seen), so `tally client add` works with
the daemon running or not. Every change is a read-modify-write under an exclusive lock on
`clients.json.lock`: the daemon's own writes (one thread per tool call) and an offline
`tally client` in another process never lose each other's clients.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from daemon import layout
from daemon.errors import Busy, Conflict, InvalidInput, NotFound
from daemon.files import PRIVATE, write_atomic
from roster.models import Whole

Scope = Literal["read", "submit", "command", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "submit", "command", "admin")
CLIENT_NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
CLIENTS_FILE = layout.CLIENTS
RESERVED = ("owner", "default")
MAX_TOKENS = 2**53 - 1
LOCK_WAIT_S = 10.0
"""How long a change waits for another writer of the client file before it gives up."""

log = logging.getLogger(__name__)


class ClientFileBroken(InvalidInput):
    """The client file is not one tally wrote (a hand edit gone wrong, damage): nothing reads
    a client from it and nothing writes over it until it is fixed (its clients would be lost).
    A bearer token is then refused (fail closed); the socket owner is unaffected."""


class Limits(BaseModel):
    """A client's rate limits and token budget (LiteLLM's virtual-key limits): None = none.
    Enforced on the gateway and on runs by `daemon.quotas`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Whole: JSON's 60.0 is the integer 60 (JSON Schema's `integer`), as in the roster.
    rpm: Annotated[int, Field(ge=1, le=1_000_000), Whole] | None = Field(
        default=None, description="Requests a minute."
    )
    tpm: Annotated[int, Field(ge=1, le=MAX_TOKENS), Whole] | None = Field(
        default=None, description="Tokens (prompt + completion) a minute."
    )
    tokens_per_day: Annotated[int, Field(ge=1, le=MAX_TOKENS), Whole] | None = Field(
        default=None, description="Tokens in any 24 hours (rolling)."
    )

    def any(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.tokens_per_day is not None


NO_LIMITS = Limits()


@dataclass(frozen=True)
class Client:
    """The principal a surface resolved from its transport; handed to every tool call."""

    name: str
    scope: Scope
    limits: Limits = NO_LIMITS

    def allows(self, needed: Scope) -> bool:
        return SCOPES.index(self.scope) >= SCOPES.index(needed)


OWNER = Client("owner", "admin")
"""The unix-socket peer (the daemon's own user)."""
DEFAULT = Client("default", "admin")
"""The holder of the legacy `http.token`."""


class ClientRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=CLIENT_NAME)
    scope: Scope
    token_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    created_at_us: int = Field(ge=0)
    limits: Limits | None = None
    """Absent in files written before limits existed, and for clients without any."""


class ClientFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: Literal[1] = 1
    clients: list[ClientRecord] = []


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ClientStore:
    """The named clients of one state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / CLIENTS_FILE
        self._mtime: tuple[int, ...] | None = None  # the file's identity when last read
        self._by_digest: dict[str, ClientRecord] = {}
        self._records: list[ClientRecord] = []
        self.broken: ClientFileBroken | None = None
        """Why the file as it is now cannot be read (None: it can)."""
        self._told: ClientFileBroken | None = None

    def _fresh(self) -> list[ClientRecord]:
        """The records, re-read if the file changed (one stat per call); ClientFileBroken
        (naming the file, the place and what to do) if it is not a client file."""
        try:
            st = self.path.stat()
            mtime: tuple[int, ...] | None = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        except FileNotFoundError:
            mtime = None
        if mtime != self._mtime:
            self._records, self._by_digest, self.broken = [], {}, None
            self._mtime = mtime
            if mtime is not None:
                try:
                    records = self._read()
                except ClientFileBroken as err:
                    self.broken = err
                    raise
                self._records = records
                self._by_digest = {r.token_sha256: r for r in records}
        if self.broken is not None:
            raise self.broken
        return self._records

    def _read(self) -> list[ClientRecord]:
        fix = (
            "fix it by hand, or move it away and add the clients again (`tally client add`; "
            "each gets a new token); until then no client token is accepted"
        )
        try:
            return ClientFile.model_validate_json(self.path.read_bytes()).clients
        except OSError as err:
            raise ClientFileBroken(
                f"client file {self.path}: unreadable ({err.strerror}); {fix}"
            ) from None
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ClientFileBroken(
                f"client file {self.path}: {where + ': ' if where else ''}{first['msg']}; {fix}",
                details={"file": str(self.path), "field": where or None},
            ) from None

    def known(self) -> list[ClientRecord]:
        """The records, or none while the file is broken (logged once per change of it): for
        the request guard and the metrics, which must answer whatever the file holds."""
        try:
            return self._fresh()
        except ClientFileBroken as err:
            if self._told is not err:  # once per change of the file, not per request
                self._told = err
                log.error("%s", err.message)
            return []

    def lookup(self, token: str) -> Client | None:
        """The client this bearer token belongs to (None: unknown or revoked, or the file is
        broken: fail closed)."""
        self.known()
        record = self._by_digest.get(digest(token))  # a 256-bit secret's digest: no timing oracle
        if record is None:
            return None
        return Client(record.name, record.scope, record.limits or NO_LIMITS)

    def records(self) -> list[ClientRecord]:
        return list(self._fresh())

    def add(self, name: str, scope: Scope, limits: Limits | None = None) -> str:
        """Make a client; returns its token (the only time it exists outside the caller)."""
        if name in RESERVED:
            raise InvalidInput(f"{name!r} is reserved (the socket owner and the legacy token)")
        with self._locked() as records:
            if any(r.name == name for r in records):
                raise Conflict(f"a client named {name!r} exists; revoke it first")
            token = "tly_" + secrets.token_urlsafe(32)
            record = ClientRecord(
                name=name,
                scope=scope,
                token_sha256=digest(token),
                created_at_us=time.time_ns() // 1000,
                limits=limits if limits is not None and limits.any() else None,
            )
            self._write([*records, record])
        return token

    def revoke(self, name: str) -> ClientRecord:
        with self._locked() as records:
            found = next((r for r in records if r.name == name), None)
            if found is None:
                raise NotFound(f"no client named {name!r}")
            self._write([r for r in records if r.name != name])
        return found

    @contextlib.contextmanager
    def _locked(self) -> Iterator[list[ClientRecord]]:
        """The records as the file holds them now, with every other writer (thread or process)
        kept out until the block ends. Blocking: the daemon calls it off its event loop."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = self.path.with_name(layout.CLIENTS_LOCK)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise Busy(
                            f"{lock} is held by another writer of the client file; try again",
                            retry_after=1.0,
                        ) from None
                    time.sleep(0.01)
            self._mtime = None  # under the lock: the file as it is now, whatever the cache says
            yield list(self._fresh())
        finally:
            os.close(fd)  # releases the lock

    def _write(self, records: list[ClientRecord]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Unset limits stay out of the file, so a file without any reads as it did before.
        data = ClientFile(clients=records).model_dump(mode="json", exclude_none=True)
        write_atomic(self.path, (json.dumps(data, indent=2) + "\n").encode(), mode=PRIVATE)
        self._mtime = None  # re-read on next use
        os.utime(self.path)  # a new mtime even within the same clock tick
