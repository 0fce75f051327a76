"""The kinds the daemon's operations write: clients, roster, routing previews and teaching,
policy and serving choices, redaction. None has a run or a parent.
"""

from __future__ import annotations

from typing import Any, ClassVar

from daemon.record.body import CLIENT, Body, Part
from daemon.record.runs import RunEmbedding


class ClientAdd(Body):
    """A client was added; `limits` only when it has any."""

    KIND: ClassVar[str] = "client.add"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"limits"})

    name: str
    scope: str
    limits: dict[str, int] | None = None


class ClientRevoke(Body):
    """A client's token was revoked."""

    KIND: ClassVar[str] = "client.revoke"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)

    name: str


class RosterReload(Body):
    """The roster was loaded again (its lanes' count and models' names)."""

    KIND: ClassVar[str] = "roster.reload"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)

    lanes: int
    models: list[str]
    client: str


class Decision(Part):
    lane: str | None
    source: str


class RoutePreview(Body):
    """`route` (a tool) showed where a text would go; scores of the top five lanes."""

    KIND: ClassVar[str] = "route.preview"
    ACTORS: ClassVar[tuple[str, ...]] = ("tool",)
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"embedding"})

    text: str
    lane: str | None
    confidence_ppm: int
    escalate: bool
    scores_ppm: dict[str, int]
    decision: Decision
    embedding: RunEmbedding | None = None
    """What the embedding member said of the text (a `run.embedding` body), only when the
    roster's `[policy] embeddings` names a member (since issue 31)."""


class RouteTeach(Body):
    """`route_teach` added an example to a lane in the roster file and reloaded it."""

    KIND: ClassVar[str] = "route.teach"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)

    lane: str
    text: str
    roster: str
    kept_comments: bool
    examples: int
    before: Decision
    after: Decision
    client: str


class PolicyUnsandboxed(Body):
    """Command tasks run without a sandbox (`[policy.command] sandbox = "none"`)."""

    KIND: ClassVar[str] = "policy.unsandboxed"
    ACTORS: ClassVar[tuple[str, ...]] = ("daemon",)

    roster: str
    command: dict[str, Any]


class ServeInsecureHttp(Body):
    """Plain HTTP beyond loopback (`--insecure-http`)."""

    KIND: ClassVar[str] = "serve.insecure_http"
    ACTORS: ClassVar[tuple[str, ...]] = ("daemon",)

    url: str
    host_names: list[str]


class Redaction(Body):
    """A body was removed (zeroed) from the store; this entry witnesses which and why."""

    KIND: ClassVar[str] = "redaction"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)

    redacted: str
    reason: str
