"""The witnessed gateway: OpenAI chat completions over the slot pool, each call in the ledger.

One piece past 500 lines: the request model, the lease, the witness and the streamed relay
share one call's state from lease to reply entry; split, each part would take all of it.

Contract:
- A model id names a pool member (`tiny`), a tier (`tier:cheap`: whichever of its members
  frees a slot first, with the pool's failover), or a lane (`lane:docs`: the lane's system
  prompt goes first and the call runs on the lane's tier, one tier up after a failed attempt).
- The request body is OpenAI's, checked field by field (`ChatRequest`): an unknown field is a
  400 that names it, never dropped. What goes upstream is exactly what the client sent, plus
  the member's model id, the slot (`id_slot` + `cache_prompt`), and streaming with usage for
  servers tally spawns (a closed stream is how a disconnect stops one).
- A call is leased, then witnessed (`gateway.call`), then sent. It ends with `gateway.reply`
  [parent: the call] — usage, timings, finish reason, TTFT, the response's hash — or with the
  error that ended it. A client that goes away cancels the upstream request; the reply entry
  says so and the slot is free again when the lease ends.
- An attempt that fails before a byte reached the client is retried (`[gateway] retries`);
  after that, a streamed error is sent in-band as OpenAI's SDKs expect.
- Refusals (unknown model, bad body, full queue, no slot before the deadline) reach no model
  and are not witnessed: a flood of them costs the ledger nothing.
- Affinity: calls whose conversation starts the same (model, system prompts, first user
  message) share an affinity key, so a follow-up lands on the slot holding its KV cache.

Entry bodies (actor = the client's name, run = null):
  gateway.call  {client, endpoint, model, target, member, instance, slot, attempt, stream,
                 affinity, queue_wait_us, request_sha256, request_bytes, request|null,
                 prepended|null,
                 upstream: what the server got beyond `request` (model id, id_slot, cache_prompt,
                 the member's sampling defaults, streaming), messages aside}
  gateway.reply {client, model, member, instance, slot, finish_reason, usage: {prompt_tokens,
                 completion_tokens, cached_tokens}, timings, ttft_us|null, duration_us,
                 text_sha256, response_sha256, response_bytes, response|null, error|null}
`request` is the client's body as the text it sent (so `request_sha256` is its hash), with
`prepended` the lane's system prompt put first (null for a member or tier); `response` the
answer's JSON text — for a stream, the completion its chunks add up to. Both are null with
`[gateway] bodies = "hashes"`. `response_sha256` hashes the bytes of a non-streamed answer,
or of a stream's chunks up to (not including) its closing tally chunk; `text_sha256` the
assistant text, so either side can check it without the body.

One piece (past 500 lines) because admission, the witnessed call, streaming, disconnects and
failover all act on one call's lease and its two entries, under the ordering stated above.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from daemon import record as rec
from daemon.clients import Client
from daemon.errors import Busy, DeadlineExceeded, InvalidInput, NotFound, TallyError
from daemon.histogram import SECONDS, Histogram
from daemon.ledger.canonical import safe
from daemon.quotas import Quotas, Refusal
from daemon.slots.errors import ConsumerGone, ModelError, PoolBusy, SlotLost
from daemon.slots.records import ledger_timings
from roster import Roster

if TYPE_CHECKING:
    from daemon.ledger import Entry, Ledger
    from daemon.slots import Pool
    from daemon.slots.chat import Completion
    from daemon.slots.lease import Lease

CALL = rec.GatewayCall.KIND
REPLY = rec.GatewayReply.KIND
FALLBACK = rec.GatewayFallback.KIND
LIMITED = rec.ClientLimited.KIND
KINDS = (CALL, REPLY, FALLBACK)

TIER = "tier:"
LANE = "lane:"


# ---------------------------------------------------------------- the request


class _Open(BaseModel):
    """A nested OpenAI object: its own fields pass through as the server defines them."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(BaseModel):
    """OpenAI's chat completion request, the fields a llama.cpp server can act on."""

    # Built by the first call (~2 ms) on the loop, not by every daemon's start.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, defer_build=True)

    model: str = Field(min_length=1, max_length=200)
    messages: list[Message] = Field(min_length=1, max_length=10_000)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=5)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0, le=1)
    typical_p: float | None = Field(default=None, ge=0, le=1)
    repeat_penalty: float | None = Field(default=None, ge=0, le=100)
    repeat_last_n: int | None = Field(default=None, ge=-1, le=1_000_000)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=-(2**31), le=2**53 - 1)
    stop: str | list[str] | None = None
    n: Literal[1] | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=512)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = Field(default=None, max_length=256)
    cache_prompt: bool | None = None
    """llama.cpp's; tally sets it anyway (another tally daemon's pool sends it)."""


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, defer_build=True)

    model: str = Field(min_length=1, max_length=200)
    input: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1, le=65_536)
    user: str | None = Field(default=None, max_length=256)


class Target(BaseModel):
    """What a model id resolved to: the pool target to lease, and the ladder above it."""

    kind: Literal["member", "tier", "lane"]
    name: str
    lease: str
    system: str | None = None
    climb: list[str] = []
    """Tiers to retry on, in order, after a failed attempt (a lane's ladder above its tier)."""


def parse_embedding(raw: bytes) -> EmbeddingRequest:
    try:
        return EmbeddingRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidInput(_explain(exc), details={"param": _first_param(exc)}) from None


def parse_request(raw: bytes, limit_tokens: int) -> ChatRequest:
    """The client's body as a ChatRequest, or InvalidInput naming every field that is wrong."""
    try:
        request = ChatRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidInput(_explain(exc), details={"param": _first_param(exc)}) from None
    asked = request.max_completion_tokens or request.max_tokens
    if asked is not None and asked > limit_tokens:
        raise InvalidInput(
            f"max_tokens {asked} is over this gateway's limit of {limit_tokens}",
            details={"param": "max_tokens"},
        )
    if request.stream_options is not None and not request.stream:
        raise InvalidInput(
            "stream_options is only allowed with stream: true", details={"param": "stream_options"}
        )
    return request


def _where(error: Any) -> str:
    return ".".join(str(part) for part in error["loc"]) or "body"


def _explain(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return "the body is not valid JSON"
    unknown = [_where(e) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return "unknown field(s): " + ", ".join(unknown) + " (this gateway does not drop fields)"
    return "; ".join(f"{_where(e)}: {e['msg']}" for e in errors[:8])


def _first_param(exc: ValidationError) -> str | None:
    errors = exc.errors(include_url=False)
    return _where(errors[0]) if errors and errors[0]["loc"] else None


def affinity_key(request: ChatRequest) -> str:
    """The conversation's stable opening: the model, every leading system message and the first
    user message. Later turns only append, so they hash the same."""
    opening: list[Any] = []
    for message in request.messages:
        opening.append(message.model_dump(mode="json", exclude_none=True))
        if message.role not in ("system", "developer"):
            break
    data = json.dumps([request.model, opening], sort_keys=True, ensure_ascii=False)
    return "gw:" + hashlib.sha256(data.encode()).hexdigest()[:24]


# ---------------------------------------------------------------- statistics


BUCKETS_S = SECONDS
RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)


@dataclass
class Usage:
    """Gateway traffic of one (client, model) since the daemon started."""

    calls: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(BUCKETS_S))
    latency: Histogram = field(default_factory=lambda: Histogram(BUCKETS_S))
    rate: Histogram = field(default_factory=lambda: Histogram(RATE_BUCKETS))


# ---------------------------------------------------------------- the gateway


Send = Callable[[dict[str, Any]], Awaitable[None]]
"""Streams one chunk to the client (the surface writes it as an SSE `data:` line)."""
Open = Callable[[dict[str, str]], Awaitable[None]]
"""Starts the client's stream with these headers (once, before the first chunk)."""


@dataclass
class Answer:
    """A finished call: the JSON body of a non-streamed answer (None when streamed) and the
    headers that name its ledger entries."""

    body: bytes | None
    headers: dict[str, str]
    ok: bool = True
    """False: a stream that failed after it began (its error chunk was sent, no [DONE])."""


class Retryable(Exception):
    """An attempt failed before any byte reached the client; `cause` says why."""

    def __init__(self, cause: TallyError) -> None:
        super().__init__(cause.message)
        self.cause = cause


class Gateway:
    """Resolves model ids, leases, witnesses, relays. Holds per-(client, model) statistics."""

    def __init__(
        self, pool: Pool, ledger: Ledger, roster: Roster, quotas: Quotas | None = None
    ) -> None:
        self.pool = pool
        self.ledger = ledger
        self.roster = roster
        self.quotas = quotas or Quotas()
        self.usage: dict[tuple[str, str], Usage] = {}
        self.waiting = 0

    def set_roster(self, roster: Roster) -> None:
        self.roster = roster

    # ------------------------------------------------------------ models

    def models(self) -> list[dict[str, Any]]:
        """OpenAI's model list: members, then `tier:` and `lane:` ids."""
        roster = self.roster
        ids = [m.name for m in roster.models if not m.agent_cli]  # a CLI is no chat model
        served = self.pool.tiers()
        ids += [TIER + t for t in roster.tiers.members if t in served]
        ids += [LANE + lane.name for lane in roster.lanes]
        return [{"id": i, "object": "model", "created": 0, "owned_by": "tally"} for i in ids]

    def resolve(self, model: str) -> Target:
        roster = self.roster
        served = self.pool.tiers()  # the pool's index, rebuilt when the roster changes
        ladder = [t for t in roster.tiers.ladder if t in served]
        if model.startswith(TIER) and model[len(TIER) :] in served:
            tier = model[len(TIER) :]
            return Target(kind="tier", name=model, lease=tier)
        if model.startswith(LANE) and (lane := roster.lane(model[len(LANE) :])) is not None:
            above = ladder[ladder.index(lane.tier) + 1 :] if lane.tier in ladder else []
            return Target(kind="lane", name=model, lease=lane.tier, system=lane.system, climb=above)
        if roster.member(model) is not None:
            return Target(kind="member", name=model, lease=model)
        raise NotFound(
            f"the model {model!r} does not exist; GET /v1/models lists members, tier:<name> "
            "and lane:<name>",
            details={"param": "model", "code": "model_not_found"},
        )

    # ------------------------------------------------------------ calls

    async def chat(self, client: Client, raw: bytes, open_stream: Open, send: Send) -> Answer:
        """One chat completion for `client`; a streamed one goes out through open/send.

        The model asked for is tried first, then each of its `[gateway] fallbacks` in order,
        while nothing has reached the client: every switch is a witnessed `gateway.fallback`
        (what failed, why, what is tried next), and every try its own call and reply."""
        settings = self.roster.gateway
        request = parse_request(raw, settings.max_tokens)
        candidates = [request.model, *settings.fallbacks.get(request.model, [])]
        self.resolve(request.model)  # an unknown model is a 404 before anything is counted
        await self.admit(client, "chat.completions")
        failed: TallyError | None = None
        for index, model in enumerate(candidates):
            try:
                target = self.resolve(model)
            except NotFound as err:  # a fallback whose tier serves nothing after a reload
                failed = err
                await self._fell_back(client, request.model, candidates, index, err)
                continue
            call = self._call(client, request, raw, target, open_stream, send)
            try:
                return await self._attempts(call, target)
            except (Busy, DeadlineExceeded, SlotLost, ModelError) as err:
                if call.opened or (isinstance(err, ModelError) and err.status_code < 500):
                    raise  # the client has bytes already, or the request itself was refused
                failed = err
                await self._fell_back(client, request.model, candidates, index, err)
        assert failed is not None
        raise failed

    def _call(
        self,
        client: Client,
        request: ChatRequest,
        raw: bytes,
        target: Target,
        open_stream: Open,
        send: Send,
    ) -> _Call:
        settings = self.roster.gateway
        body = request.model_dump(mode="json", exclude_unset=True)
        if target.system is not None:
            body["messages"] = [{"role": "system", "content": target.system}, *body["messages"]]
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = settings.max_tokens
        return _Call(
            gateway=self,
            client=client,
            request=request,
            body=body,
            raw=raw,
            affinity=affinity_key(request) if settings.affinity else None,
            prepended=target.system is not None,
            open_stream=open_stream,
            send=send,
        )

    async def _attempts(self, call: _Call, target: Target) -> Answer:
        rungs = [target.lease, *target.climb]
        attempts = 1 + self.roster.gateway.retries
        for attempt in range(1, attempts + 1):
            lease_target = rungs[min(attempt - 1, len(rungs) - 1)]
            try:
                return await call.attempt(target, lease_target, attempt)
            except Retryable as failed:
                if attempt == attempts:
                    raise failed.cause from None
        raise AssertionError("unreachable")

    async def _fell_back(
        self, client: Client, asked: str, candidates: list[str], index: int, err: TallyError
    ) -> None:
        """Witness that `candidates[index]` could not serve (and what is tried next, if any)."""
        if len(candidates) == 1:
            return  # no fallbacks configured: the error is the answer, as before
        following = candidates[index + 1] if index + 1 < len(candidates) else None
        body = rec.GatewayFallback(
            client=client.name,
            model=asked,
            failed=candidates[index],
            error=err.message[:500],
            code=err.code,
            next=following,
        )
        await self.ledger.append(actor=client.name, kind=body.KIND, body=body.written())

    async def admit(self, client: Client, endpoint: str) -> None:
        """Count one request of `client`, or refuse it with 429 (witnessed once a minute)."""
        refusal = self.quotas.admit(client)
        if refusal is None:
            return
        await self.witness_refusal(refusal, endpoint)
        raise refusal.error()

    async def witness_refusal(self, refusal: Refusal, surface: str) -> None:
        if not self.quotas.witness_due(refusal):
            return
        body = rec.ClientLimited(
            client=refusal.client,
            limit=refusal.limit,
            allowed=refusal.allowed,
            used=refusal.used,
            retry_after_ms=int(refusal.retry_after * 1000),
            surface=surface,
        )
        await self.ledger.append(actor=refusal.client, kind=body.KIND, body=body.written())

    async def embed(self, client: Client, raw: bytes) -> Answer:
        """Embeddings, passed through to a member that serves them; witnessed like a chat."""
        request = parse_embedding(raw)
        target = self.resolve(request.model)
        await self.admit(client, "embeddings")
        deadline = time.monotonic() + self.roster.gateway.queue_timeout_s
        waited = time.monotonic()
        async with self.pool.lease(target.lease, deadline=deadline) as lease:
            wait_us = int((time.monotonic() - waited) * 1e6)
            where: dict[str, Any] = {
                "client": client.name,
                "model": request.model,
                "member": lease.member,
                "instance": lease.instance,
                "slot": lease.id_slot,
            }
            body = rec.GatewayCall(
                **where,
                endpoint="embeddings",
                target=f"{target.kind}:{target.lease}",
                attempt=1,
                stream=False,
                affinity=None,
                queue_wait_us=wait_us,
                request_sha256=hashlib.sha256(raw).hexdigest(),
                request_bytes=len(raw),
                request=None,  # inputs can be large; their hash is the witness
                upstream=None,
                prepended=None,
            )
            call = await self.ledger.append(actor=client.name, kind=body.KIND, body=body.written())
            started = time.monotonic()
            try:
                answer = await lease.embed(request.model_dump(mode="json", exclude_unset=True))
            except TallyError as err:
                await self._embedded(client, call.seq, where, started, None, err.message)
                raise
            answer["model"] = request.model
            data = json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode()
            seq = await self._embedded(client, call.seq, where, started, data, None)
        checkpoint = self.ledger.latest_checkpoint()
        headers = {
            "X-Tally-Seq": str(seq),
            "X-Tally-Call-Seq": str(call.seq),
            "X-Tally-Checkpoint": str(checkpoint.size if checkpoint else 0),
        }
        return Answer(data, headers)

    async def _embedded(
        self,
        client: Client,
        call_seq: int,
        where: dict[str, Any],
        started: float,
        data: bytes | None,
        error: str | None,
    ) -> int:
        usage = json.loads(data).get("usage") if data else None
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        reply = rec.GatewayReply(
            **where,
            finish_reason=None,
            usage=rec.GatewayUsage(
                prompt_tokens=prompt if isinstance(prompt, int) else 0,
                completion_tokens=0,
                cached_tokens=0,
            ),
            timings={},
            ttft_us=None,
            duration_us=int((time.monotonic() - started) * 1e6),
            text_sha256=None,
            response_sha256=hashlib.sha256(data).hexdigest() if data else None,
            response_bytes=len(data) if data else 0,
            response=None,
            error=error,
        )
        entry = await self.ledger.append(
            actor=client.name, kind=reply.KIND, parent=call_seq, body=reply.written()
        )
        stats = self.stats(client.name, str(where["model"]))
        if error is None:
            stats.calls += 1
            stats.prompt_tokens += prompt if isinstance(prompt, int) else 0
            self.quotas.spend(client.name, prompt if isinstance(prompt, int) else 0)
            stats.latency.observe(time.monotonic() - started)
        else:
            stats.errors += 1
        return entry.seq

    def stats(self, client: str, model: str) -> Usage:
        return self.usage.setdefault((client, model), Usage())


@dataclass
class _Call:
    """One client request across its attempts."""

    gateway: Gateway
    client: Client
    request: ChatRequest
    body: dict[str, Any]
    raw: bytes
    affinity: str | None
    open_stream: Open
    send: Send
    prepended: bool = False
    opened: bool = False
    sent_bytes: Any = field(default_factory=hashlib.sha256)
    sent_size: int = 0

    async def attempt(self, target: Target, lease_target: str, attempt: int) -> Answer:
        gw = self.gateway
        waited = time.monotonic()
        lease = gw.pool.try_acquire(lease_target, self.affinity) or await self._wait(lease_target)
        try:
            queue_wait_us = int((time.monotonic() - waited) * 1e6)
            upstream = lease.relay_body(self.body)
            where = f"{target.kind}:{lease_target}"
            # The call entry's write overlaps the request: nothing reaches the client (no chunk,
            # no answer) before it is durable, and the reply names it as its parent.
            call = self._witness_call(where, lease, attempt, queue_wait_us, upstream)
            try:
                return await self._relay(lease, upstream, call)
            finally:
                if not call.done():
                    call.cancel()  # the ledger still commits it (a cancel stops only the wait)
        finally:
            lease.release()

    async def _wait(self, lease_target: str) -> Lease:
        """Queue for a slot, within the gateway's own bound on waiting calls."""
        gw = self.gateway
        settings = gw.roster.gateway
        if gw.waiting >= settings.max_waiting:
            raise PoolBusy(
                f"{gw.waiting} gateway calls are waiting for a slot (max_waiting); retry",
                retry_after=1.0,
            )
        gw.waiting += 1
        try:
            deadline = time.monotonic() + settings.queue_timeout_s
            return await gw.pool.acquire(lease_target, deadline=deadline, affinity=self.affinity)
        finally:
            gw.waiting -= 1

    def _witness_call(
        self, target: str, lease: Lease, attempt: int, wait_us: int, upstream: dict[str, Any]
    ) -> asyncio.Future[Entry]:
        keep = self.gateway.roster.gateway.bodies == "store"
        body = rec.GatewayCall(
            client=self.client.name,
            endpoint="chat.completions",
            model=self.request.model,
            target=target,
            member=lease.member,
            instance=lease.instance,
            slot=lease.id_slot,
            attempt=attempt,
            stream=self.request.stream,
            affinity=self.affinity,
            queue_wait_us=wait_us,
            request_sha256=hashlib.sha256(self.raw).hexdigest(),
            request_bytes=len(self.raw),
            # the client's own bytes, as text: `request_sha256` is their hash
            request=self.raw.decode() if keep else None,
            prepended=self.body["messages"][0]["content"] if self.prepended else None,
            upstream=safe(
                {k: v for k, v in upstream.items() if k != "messages" and self.body.get(k) != v}
            ),
        )
        return self.gateway.ledger.append_soon(
            actor=self.client.name, kind=body.KIND, body=body.written()
        )

    async def _relay(
        self, lease: Lease, upstream: dict[str, Any], call: asyncio.Future[Entry]
    ) -> Answer:
        started = time.monotonic()
        clock = _Clock(started)
        relay = self._forward if self.request.stream else _first_token
        try:
            done = await lease.send(upstream, on_chunk=lambda c: relay(c, call, clock))
            call_seq = (await call).seq
        except asyncio.CancelledError:
            why = "client disconnected (cancelled)"
            await asyncio.shield(self._witness_error(lease, call, started, why))
            raise
        except (SlotLost, ModelError) as err:
            await self._witness_error(lease, call, started, err.message)
            if not self.opened and (not isinstance(err, ModelError) or err.status_code >= 500):
                raise Retryable(err) from None
            if self.opened:
                await self.send({"error": _openai_error(err)})
                return Answer(None, {}, ok=False)
            raise
        except ConsumerGone:  # writing to the client failed: it went away
            await self._witness_error(lease, call, started, "client disconnected")
            raise ConnectionResetError("the client disconnected") from None
        except Exception as err:
            if call.done() and call.exception() is err:
                raise  # the call entry itself could not be written: nothing to witness with
            await self._witness_error(lease, call, started, repr(err)[:500])
            raise
        return await self._finish(lease, done, call_seq, started, clock)

    async def _forward(
        self, chunk: dict[str, Any], call: asyncio.Future[Entry], clock: _Clock
    ) -> None:
        """One upstream chunk to the client: the model id it asked for; usage only at the end."""
        if not chunk.get("choices") and chunk.get("usage") is not None:
            return  # the usage chunk: sent by `_finish`, after the reply is witnessed
        if clock.first is None and _has_tokens(chunk):
            clock.first = time.monotonic()
        if not self.opened:
            call_seq = (await call).seq
            self.opened = True
            await self.open_stream(self._headers(call_seq, "X-Tally-Call-Seq"))
        out = {**chunk, "model": self.request.model}
        out.pop("timings", None)
        data = json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()
        self.sent_bytes.update(data)
        self.sent_size += len(data)
        await self.send(out)

    def _headers(self, seq: int, name: str) -> dict[str, str]:
        checkpoint = self.gateway.ledger.latest_checkpoint()
        return {name: str(seq), "X-Tally-Checkpoint": str(checkpoint.size if checkpoint else 0)}

    async def _finish(
        self, lease: Lease, done: Completion, call_seq: int, started: float, clock: _Clock
    ) -> Answer:
        gw = self.gateway
        duration = time.monotonic() - started
        text_sha = hashlib.sha256(done.text.encode()).hexdigest()
        keep = gw.roster.gateway.bodies == "store"
        response = {**done.response(), "model": self.request.model}
        response.pop("timings", None)
        data = json.dumps(response, ensure_ascii=False, separators=(",", ":")).encode()
        if self.request.stream:
            response_sha, response_size = self.sent_bytes.hexdigest(), self.sent_size
        else:
            response_sha, response_size = hashlib.sha256(data).hexdigest(), len(data)
        ttft_us = None if clock.first is None else int((clock.first - started) * 1e6)
        usage = done.usage
        reply = rec.GatewayReply(
            **self._where(lease),
            finish_reason=done.finish_reason,
            usage=rec.GatewayUsage(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
            ),
            timings=ledger_timings(done.timings),
            ttft_us=ttft_us,
            duration_us=int(duration * 1e6),
            text_sha256=text_sha,
            response_sha256=response_sha,
            response_bytes=response_size,
            response=data.decode() if keep else None,
            error=None,
        )
        entry = await gw.ledger.append(
            actor=self.client.name, kind=reply.KIND, parent=call_seq, body=reply.written()
        )
        self._count(done, duration, ttft_us)
        headers = self._headers(entry.seq, "X-Tally-Seq")
        if not self.request.stream:
            return Answer(data, {**headers, "X-Tally-Call-Seq": str(call_seq)})
        await self._close_stream(done, entry.seq, call_seq, headers)
        return Answer(None, headers)

    async def _close_stream(
        self, done: Completion, seq: int, call_seq: int, headers: dict[str, str]
    ) -> None:
        if not self.opened:  # an answer with no chunk at all (nothing generated)
            self.opened = True
            await self.open_stream({"X-Tally-Call-Seq": str(call_seq)})
        tail: dict[str, Any] = {
            "id": done.id or "chatcmpl-tally",
            "object": "chat.completion.chunk",
            "created": done.created or int(time.time()),
            "model": self.request.model,
            "choices": [],
            "tally": {"seq": seq, "checkpoint": int(headers["X-Tally-Checkpoint"])},
        }
        if (self.request.stream_options or {}).get("include_usage"):
            tail["usage"] = done.response()["usage"]
        await self.send(tail)

    def _where(self, lease: Lease) -> dict[str, Any]:
        return {
            "client": self.client.name,
            "model": self.request.model,
            "member": lease.member,
            "instance": lease.instance,
            "slot": lease.id_slot,
        }

    async def _witness_error(
        self, lease: Lease, call: asyncio.Future[Entry], started: float, why: str
    ) -> None:
        self.gateway.stats(self.client.name, self.request.model).errors += 1
        call_seq = (await asyncio.shield(call)).seq
        # `usage` null: the server reported nothing (`GatewayReply.tokens` reads it as 0, 0)
        reply = rec.GatewayReply(
            **self._where(lease),
            finish_reason=None,
            usage=None,
            timings={},
            ttft_us=None,
            duration_us=int((time.monotonic() - started) * 1e6),
            text_sha256=None,
            response_sha256=None,
            response_bytes=0,
            response=None,
            error=why,
        )
        await self.gateway.ledger.append(
            actor=self.client.name, kind=reply.KIND, parent=call_seq, body=reply.written()
        )

    def _count(self, done: Completion, duration: float, ttft_us: int | None) -> None:
        self.gateway.quotas.spend(
            self.client.name, done.usage.prompt_tokens + done.usage.completion_tokens
        )
        stats = self.gateway.stats(self.client.name, self.request.model)
        stats.calls += 1
        stats.prompt_tokens += done.usage.prompt_tokens
        stats.completion_tokens += done.usage.completion_tokens
        stats.latency.observe(duration)
        if ttft_us is not None:
            stats.ttft.observe(ttft_us / 1e6)
            generating = duration - ttft_us / 1e6
            if generating > 0 and done.usage.completion_tokens > 1:
                stats.rate.observe((done.usage.completion_tokens - 1) / generating)


@dataclass
class _Clock:
    started: float
    first: float | None = None


def _has_tokens(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls"):
            return True
    return False


async def _first_token(chunk: dict[str, Any], call: asyncio.Future[Entry], clock: _Clock) -> None:
    """A non-streamed answer read from a streamed upstream: only its first token's time."""
    if clock.first is None and _has_tokens(chunk):
        clock.first = time.monotonic()


def _openai_error(err: TallyError) -> dict[str, Any]:
    return {"message": err.message, "type": "server_error", "code": err.code, "param": None}
