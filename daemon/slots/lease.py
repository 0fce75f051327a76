"""A lease: one slot of one server, held by one caller (the engine, the gateway) until released.

Contract. A lease is granted by the pool with its slot already taken, and `release()` (once;
later calls do nothing) hands the slot back to its member, which grants it to the earliest
waiter. While it is held the slot is the caller's alone: requests carry its `id_slot` (when
the server can pin slots) and `cache_prompt`, so a lane's prefix stays warm. Faults of the
server under it surface as `SlotLost`, never as a hang or a transport error: the server dying
or hanging (told through `lose`, or seen by the request itself: a timeout, a refused or
dropped connection) fails the call in flight, and the lease reports what it saw to the
server's instance (`report_fault`, or `check_soon` when a probe must decide). An error status
is a `ModelError` (the slot itself is fine). A caller's own cancel stays a cancel.

In-flight failover (`chat` only; `send`, the gateway's path, never moves a call: the gateway
retries on its own). A lease aimed at a tier of several members may move a call that failed
in flight to another of them, once, and then holds that member's slot: `member`, `instance`
and `id_slot` always name the slot the lease holds now, which is where the last attempt ran.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import aiohttp

from daemon.slots.chat import Completion, OnChunk, OnDelta, reply_cap, request_body
from daemon.slots.discovery import connection_problem
from daemon.slots.errors import BadReply, ModelError, SlotLost
from daemon.slots.instance import Slot
from daemon.slots.records import ChatResult

log = logging.getLogger("tally.slots")


class Failover(Protocol):
    """Where a lease on a tier takes a call that failed in flight (the pool provides it)."""

    @property
    def tier(self) -> str: ...

    async def move(self, failed: dict[str, str], error: SlotLost | ModelError) -> Slot:
        """A slot of a member of the tier not in `failed` (member → why its call failed),
        taken for the lease; or, when the call may not move again or none can take it,
        `error` itself (the pool is stopping) or a SlotLost naming every member and why."""


class Lease:
    """One leased slot. `chat` talks to it; the slot returns to the pool when the lease ends."""

    __slots__ = (
        "_failover",
        "_lost",
        "_member",
        "_released",
        "_slot",
        "_task",
        "id_slot",
        "instance",
        "member",
    )

    def __init__(self, slot: Slot, failover: Failover | None = None) -> None:
        self._failover = failover
        self._released = False
        self._task: asyncio.Task[Any] | None = None
        self._hold(slot)

    def _hold(self, slot: Slot) -> None:
        self._member = slot.instance.member
        self._slot = slot
        self._lost: str | None = None
        self.member = self._member.name
        self.instance = slot.instance.index
        self.id_slot = slot.id
        slot.lease = self

    @property
    def server_url(self) -> str | None:
        """The server's root URL (for /slots, /metrics); None once it is gone."""
        return self._slot.instance.root_url if self._slot.alive else None

    @property
    def lost(self) -> str | None:
        return self._lost

    def lose(self, reason: str) -> None:
        """Called by the pool when the server under this lease died or hung."""
        self._lost = reason
        task = self._task
        if task is not None and not task.done():
            task.cancel()

    def _lost_error(self) -> SlotLost:
        return SlotLost(
            f"slot {self.id_slot} of {self.member}/{self.instance} was lost: {self._lost}",
            details={"member": self.member, "instance": self.instance, "id_slot": self.id_slot},
        )

    def request(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        response_format: dict[str, Any] | None = None,
        *,
        stream: bool = False,
    ) -> dict[str, Any]:
        """The exact body `chat` sends for these arguments, so a caller can witness it first."""
        spec = self._member.spec
        return request_body(
            spec,
            self.id_slot if self._slot.instance.send_id_slot else None,
            messages,
            max_tokens=max_tokens,
            response_format=response_format,
            # llama.cpp notices a closed connection only while streaming (a non-streamed
            # request was measured generating on after its client left), so cancel can only
            # stop a server we own if we stream; the caller still gets one ChatResult.
            stream=stream or spec.url is None,
        )

    async def chat(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        response_format: dict[str, Any] | None = None,
        on_delta: OnDelta | None = None,
        extra: dict[str, Any] | None = None,
    ) -> ChatResult:
        """POST /v1/chat/completions on this slot; streams (SSE) when `on_delta` is given.

        On a lease aimed at a tier, a call whose server fails in flight (dies, hangs, refuses,
        drops the connection or answers a 5xx) before any of its reply reached `on_delta`
        moves once to another member of the tier: the failed member is reported (an external
        one is unhealthy at once and probed; a spawned one's supervision restarts it if it is
        down), the lease lets its slot go and holds the new one (`member`, `instance` and
        `id_slot` name it from then on), a `slot.failover` event names both members and why,
        and the call is sent anew. A call that fails again, or finds no member to move to,
        raises SlotLost naming each member of the tier and why, so the caller climbs its
        ladder at once. Text a consumer already has is never sent twice: such a call is not
        moved, and raises what it met.
        """
        streamed = False

        def relay(text: str) -> object:
            nonlocal streamed
            streamed = True
            assert on_delta is not None
            return on_delta(text)

        failed: dict[str, str] = {}
        while True:
            body = self.request(messages, max_tokens, response_format, stream=on_delta is not None)
            if extra:
                body.update(extra)
            try:
                done = await self.send(body, on_delta=relay if on_delta is not None else None)
                break
            except (SlotLost, ModelError) as err:
                if self._failover is None or streamed or not _in_flight(err):
                    raise
                failed[self.member] = self._report(err)
                await self._move(failed, err)
        return ChatResult(
            text=done.text,
            finish_reason=done.finish_reason,
            usage=done.usage,
            timings=done.timings,
            member=self.member,
            instance=self.instance,
            id_slot=self.id_slot,
            request=body,
            model=done.model,
            remote=done.remote,
        )

    def relay_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """A client's own request body as this slot's server gets it: the member's model id,
        the slot pinned and its cache kept; a server tally spawns is always streamed (see
        `request`), and a stream always reports usage (the ledger meters it)."""
        spec = self._member.spec
        sent = dict(body)
        for key, value in spec.sampling.model_dump(exclude_none=True).items():
            sent.setdefault(key, value)  # the member's defaults; the client's values win
        sent["model"] = spec.model_id or spec.name
        sent["cache_prompt"] = True
        if self._slot.instance.send_id_slot:
            sent["id_slot"] = self.id_slot
        if sent.get("stream") or spec.url is None:
            sent["stream"] = True
            sent["stream_options"] = {**(sent.get("stream_options") or {}), "include_usage": True}
        return sent

    async def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/embeddings on this slot's server with the member's model id."""
        instance = self._slot.instance
        spec = self._member.spec
        url = instance.chat_url.removesuffix("/chat/completions") + "/embeddings"
        sent = {**body, "model": spec.model_id or spec.name}
        try:
            async with asyncio.timeout(spec.request_timeout_s):
                return await instance.ctx.client.post_json(
                    url, sent, instance.headers, limit=spec.max_reply_mb * 2**20
                )
        except BadReply as err:
            raise self._blame(err) from None
        except (TimeoutError, aiohttp.ClientError) as err:
            raise SlotLost(
                f"embeddings on {self.member}/{self.instance} failed: {err!r}",
                details={"member": self.member, "instance": self.instance},
            ) from None

    async def send(
        self,
        body: dict[str, Any],
        *,
        on_delta: OnDelta | None = None,
        on_chunk: OnChunk | None = None,
    ) -> Completion:
        """POST `body` as is to this slot's server; faults become SlotLost (see `chat`)."""
        if self._lost is not None:
            raise self._lost_error()
        if self._released:
            raise RuntimeError("the lease has ended")
        instance = self._slot.instance
        spec = self._member.spec
        task = asyncio.current_task()
        self._task = task
        try:
            # One deadline for the whole call, however slowly its reply drips in.
            async with asyncio.timeout(spec.request_timeout_s):
                return await instance.ctx.client.complete(
                    instance.chat_url,
                    body,
                    instance.headers,
                    on_delta,
                    on_chunk,
                    limit=reply_cap(body, spec.max_reply_mb * 2**20),
                )
        except asyncio.CancelledError:
            # Our own cancel from lose() becomes SlotLost; a caller's cancel stays a cancel.
            if self._lost is not None and task is not None and task.cancelling() <= 1:
                task.uncancel()
                raise self._lost_error() from None
            raise
        except TimeoutError:
            self._task = None
            self._lost = f"hung: no reply within {spec.request_timeout_s:g} s"
            instance.report_fault(self._lost)
            raise self._lost_error() from None
        except aiohttp.ClientError as err:
            self._task = None
            if self._lost is None:
                if isinstance(err, aiohttp.ClientConnectorError):  # nobody there (refused, …)
                    self._lost = connection_problem(err, instance.chat_url, 0)
                    instance.report_fault(self._lost)
                else:
                    self._lost = f"connection failed: {err!r}"
                    if spec.url is None:  # a loopback server we own does not drop connections
                        instance.report_fault(self._lost)
                    else:  # an external one may (a proxy, a restart): is it still there?
                        instance.check_soon()
            raise self._lost_error() from None
        except BadReply as err:
            raise self._blame(err) from None
        except ModelError as err:
            if err.status_code >= 500 and spec.url is not None:
                instance.check_soon()  # a bad request or a server going away: a probe tells
            raise
        finally:
            self._task = None

    def _blame(self, err: BadReply) -> BadReply:
        """A reply no model server should send: the member's fault, shown as its last error
        (`slots`), with a health check soon; the call fails with the member named."""
        instance = self._slot.instance
        why = f"{self.member}/{self.instance}: {err.message}"
        instance.last_error = instance.member.last_error = why
        log.warning("%s", why)
        instance.check_soon()
        return type(err)(why, details={k: v for k, v in err.details.items() if k != "status_code"})

    def _report(self, err: SlotLost | ModelError) -> str:
        """Tell the failed call's server it failed (see `chat`); why, for the record."""
        why = self._lost if isinstance(err, SlotLost) and self._lost else err.message
        instance = self._slot.instance
        if self._slot.alive:  # else its server is already gone, and being dealt with
            if self._member.spec.url is not None:
                instance.report_fault(f"a call failed in flight: {why}")
            else:
                instance.check_soon()  # a spawned server's supervision decides on a restart
        return why

    async def _move(self, failed: dict[str, str], err: SlotLost | ModelError) -> None:
        assert self._failover is not None
        source = self._slot.instance
        slot = await self._failover.move(failed, err)
        self._member.release(self._slot)
        self._hold(slot)
        await source.emit(
            "slot.failover",
            reason=failed[source.member.name],
            tier=self._failover.tier,
            in_flight=True,
            from_member=source.member.name,
            to_member=self.member,
        )

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._member.release(self._slot)


def _in_flight(err: SlotLost | ModelError) -> bool:
    """A failure of the server rather than of the request: another member may well answer."""
    return isinstance(err, SlotLost) or err.status_code >= 500
