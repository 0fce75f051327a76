"""Embeddings for routing: the roster's embedding member, its vectors of the lanes' example
requests cached on disk, and a request's likeness to each lane's examples.

When `[policy] embeddings` names a member serving an OpenAI-compatible `/v1/embeddings`
(llama.cpp with `--embeddings --pooling mean`, Ollama's `nomic-embed-text`, ...), a route also
asks it for the request's vector and compares it with every lane's examples; the router adds
the lane's nearest-example cosine to its evidence (daemon.router, `EMBED_WEIGHT`).

**The cache.** Embedding hundreds of examples takes minutes on a small CPU model, so each
example's vector is kept in `<state>/embeddings/<member>.json`, keyed by
`sha256(model digest, example text)`: a changed example is embedded again alone, a changed
model (another file, other weights, other pooling) changes every key. The model digest is the
member's identity (name, model file or id, its sha256 when the roster pins one) together with
the vector the server gives a fixed probe text, so whatever changes what the server computes
changes the digest. The file is written atomically (a temporary file, fsync, rename, fsync of
the directory). It is a cache, never trusted as it stands: a file that is too big, not JSON,
of the wrong shape, of another digest, with a vector of the wrong size or with a non-finite or
zero vector is dropped and rebuilt (the reason kept in `problem`), and before any cached
vector is used a few of them are embedded again and must agree (cosine >= `SPOT_MIN`).

**Centring.** A small decoder's mean-pooled vectors all point much the same way (cosines of
unrelated sentences near 0.9); the mean of the examples' vectors is taken off every vector
before the cosine, so the cosine measures what sets a request apart.

**Falling back.** Every failure (no member, a member down, a timeout, a malformed answer, the
vectors still being built) gives a `Likeness` with `used` False and `why`: the route then
scores as if no member were configured, and says so.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import math
import operator
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from roster.models import Lane, Roster

PROBE = "tally: a fixed sentence whose vector identifies the embedding model"
BATCH = 16
"""Texts embedded under one lease (and one deadline) while building the example vectors."""
QUERY_TIMEOUT_S = 10.0
"""A request's vector: past this the route falls back to the deterministic score."""
BUILD_TIMEOUT_S = 600.0
"""One batch of example vectors (a cold CPU model on a busy machine is slow)."""
RETRY_S = 30.0
"""After a failed build, routes fall back for this long before the member is asked again."""
SPOT_CHECK = 2
SPOT_MIN = 0.99
MAX_CACHE_BYTES = 256 * 2**20
MAX_DIM = 16_384
QUERIES = 256
"""Requests whose vectors are kept in memory, so `route` and the `submit` after it agree."""
SHOWN = 5
FLOAT32_MAX = 3.4e38
"""Vectors are cached as float32: a larger (or non-finite) value is refused."""


class EmbedLease(Protocol):
    async def embed(self, body: dict[str, Any]) -> dict[str, Any]: ...


class EmbedPool(Protocol):
    def lease(
        self,
        target: str,
        priority: int = 0,
        deadline: float | None = None,
        affinity: str | None = None,
    ) -> contextlib.AbstractAsyncContextManager[EmbedLease]: ...


class Likeness(BaseModel):
    """What the embedding member said about one request: per lane, the cosine (centred) of
    its nearest example and that example; or, with `used` False, why it was not used."""

    model_config = ConfigDict(frozen=True)

    member: str
    used: bool
    why: str | None = None
    digest: str | None = None
    """The model digest the example vectors are keyed by."""
    examples: int = 0
    """Example vectors compared."""
    lanes: dict[str, tuple[float, str]] = {}
    ms: int = 0
    """Wall time of the request's embedding call (0: its vector was already known)."""

    def shown(self) -> dict[str, Any]:
        """As the `route` tool and `tally route --json` show it (`nearest`: the best lanes)."""
        return {
            "member": self.member,
            "used": self.used,
            "why": self.why,
            "digest": self.digest,
            "examples": self.examples,
            "ms": self.ms,
            "nearest": [
                {"lane": lane, "cosine": value, "example": text} for lane, value, text in self.top()
            ],
        }

    def top(self, count: int = SHOWN) -> list[tuple[str, float, str]]:
        ranked = sorted(self.lanes.items(), key=lambda item: (-item[1][0], item[0]))
        return [(lane, cosine, text) for lane, (cosine, text) in ranked[:count]]


class EmbeddingError(Exception):
    """The member's answer cannot be used (said in the route's `why`)."""


class _CacheFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    v: int = Field(ge=1, le=1)
    member: str = Field(max_length=200)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    dim: int = Field(ge=1, le=MAX_DIM)
    vectors: dict[str, str]


def example_key(digest: str, text: str) -> str:
    """The cache key of `text`'s vector under the model `digest`."""
    return hashlib.sha256(f"{digest}\0{text}".encode()).hexdigest()


class VectorCache:
    """`<dir>/<member>.json`: the example vectors of one member, keyed by `example_key`."""

    def __init__(self, directory: Path, member: str) -> None:
        self.path = directory / f"{member}.json"
        self.member = member

    def load(self, digest: str) -> tuple[dict[str, list[float]], str | None]:
        """The vectors cached under `digest`, and why none were, if none were (a missing file
        is no problem). A hostile or stale file gives nothing: the caller rebuilds."""
        try:
            with self.path.open("rb") as f:
                raw = f.read(MAX_CACHE_BYTES + 1)
        except FileNotFoundError:
            return {}, None
        except OSError as err:
            return {}, f"{self.path.name}: unreadable ({err.strerror}): rebuilt"
        if len(raw) > MAX_CACHE_BYTES:
            return {}, f"{self.path.name}: over {MAX_CACHE_BYTES >> 20} MiB: rebuilt"
        try:
            data = _CacheFile.model_validate_json(raw)
        except ValidationError as err:
            where = ".".join(str(p) for p in err.errors()[0]["loc"]) or "file"
            return {}, f"{self.path.name}: not a vector cache ({where}): rebuilt"
        if data.digest != digest:
            return {}, f"{self.path.name}: made with another model (digest {data.digest[:12]})"
        vectors: dict[str, list[float]] = {}
        for key, encoded in data.vectors.items():
            vector = _decode(encoded, data.dim)
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key) or vector is None:
                return {}, f"{self.path.name}: a malformed vector under {key[:16]!r}: rebuilt"
            vectors[key] = vector
        return vectors, None

    def save(self, digest: str, dim: int, vectors: dict[str, list[float]]) -> None:
        """Replace the file atomically with exactly `vectors` (the current examples')."""
        body = {
            "v": 1,
            "member": self.member,
            "digest": digest,
            "dim": dim,
            "vectors": {key: _encode(vector) for key, vector in sorted(vectors.items())},
        }
        data = json.dumps(body, separators=(",", ":")).encode()
        directory = self.path.parent
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True)
            _fsync_dir(directory.parent)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(directory)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode(vector: Sequence[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _decode(encoded: str, dim: int) -> list[float] | None:
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(raw) != 4 * dim:
        return None
    vector = list(struct.unpack(f"<{dim}f", raw))
    if not all(math.isfinite(x) for x in vector) or not any(vector):
        return None
    return vector


def vectors_of(answer: Any, count: int) -> list[list[float]]:
    """The `count` vectors of an OpenAI embeddings answer, in input order; a member's answer
    is hostile like any other: shape, size, finiteness and equal dimensions are checked."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or len(data) != count:
        raise EmbeddingError(f"the answer holds no list of {count} embeddings")
    found: dict[int, list[float]] = {}
    for item in data:
        index = item.get("index") if isinstance(item, dict) else None
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(index, int) or not 0 <= index < count or index in found:
            raise EmbeddingError("an embedding with a missing, repeated or stray index")
        if not isinstance(vector, list) or not 0 < len(vector) <= MAX_DIM:
            raise EmbeddingError(f"embedding {index} is not a list of 1-{MAX_DIM} numbers")
        if not all(type(x) in (int, float) and abs(x) <= FLOAT32_MAX for x in vector):
            raise EmbeddingError(f"embedding {index} holds a value that is not a finite number")
        if not any(vector):
            raise EmbeddingError(f"embedding {index} is all zeros")
        found[index] = [float(x) for x in vector]
    vectors = [found[i] for i in range(count)]
    if len({len(v) for v in vectors}) != 1:
        raise EmbeddingError("the embeddings differ in size")
    return vectors


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


def _unit(vector: Sequence[float], mean: Sequence[float]) -> list[float]:
    centred = [x - m for x, m in zip(vector, mean, strict=True)]
    norm = math.sqrt(math.fsum(x * x for x in centred)) or 1.0
    return [x / norm for x in centred]


class Embeddings:
    """The embedding member of a roster, and its example vectors (built once, then cached)."""

    def __init__(self, roster: Roster, member: str, pool: EmbedPool, cache_dir: Path) -> None:
        self.member = member
        self.pool = pool
        self.cache = VectorCache(cache_dir, member)
        spec = roster.member(member)
        self._identity = {
            "member": member,
            "model": spec.model if spec else None,
            "model_sha256": spec.model_sha256 if spec else None,
            "model_id": spec.model_id if spec else None,
            "url": spec.url if spec else None,
        }
        self._examples: list[tuple[str, str]] = [
            (lane.name, text) for lane in _lanes(roster) for text in lane.examples
        ]
        self.digest: str | None = None
        self.state = "not built"
        """"not built", "building", "ready", "down" (`why` says what failed)."""
        self.why: str | None = None
        self.problem: str | None = None
        """Why the cache file on disk was not used at the last build (None: it was, or none)."""
        self.reused = 0
        self.computed = 0
        self.build_ms = 0
        self._units: list[list[float]] = []
        self._mean: list[float] = []
        self._build: asyncio.Task[None] | None = None
        self._failed_at = 0.0
        self._queries: OrderedDict[str, list[float]] = OrderedDict()
        self.query_timeout_s = QUERY_TIMEOUT_S

    # ---------------------------------------------------------------- the member

    async def _embed(self, texts: list[str], timeout: float) -> list[list[float]]:
        """One text per call: llama.cpp (xllamacpp 2026.10, `--parallel 2`) gave a text
        embedded beside others in one call another vector than alone (cosine 0.84-0.93 for
        every other input), so a batch would make the vectors depend on their neighbours."""
        deadline = time.monotonic() + timeout
        vectors: list[list[float]] = []
        async with asyncio.timeout(timeout):
            async with self.pool.lease(self.member, deadline=deadline) as lease:
                for text in texts:
                    answer = await lease.embed({"input": [text]})
                    vectors.extend(vectors_of(answer, 1))
        if len({len(v) for v in vectors}) > 1:
            raise EmbeddingError("the embeddings differ in size")
        return vectors

    # ---------------------------------------------------------------- building

    def start(self) -> None:
        """Start building the example vectors in the background (once; again after RETRY_S
        when a build failed)."""
        if self.state == "ready" or (self._build is not None and not self._build.done()):
            return
        if self.state == "down" and time.monotonic() - self._failed_at < RETRY_S:
            return
        self.state = "building"
        self._build = asyncio.get_running_loop().create_task(self._built())

    async def ready(self, wait: float) -> bool:
        """Whether the example vectors are built, waiting up to `wait` seconds for them."""
        self.start()
        if self.state != "ready" and self._build is not None and wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._build), wait)
        return self.state == "ready"

    async def _built(self) -> None:
        started = time.monotonic()
        try:
            await self._make()
        except asyncio.CancelledError:
            self.state = "not built"
            raise
        except Exception as err:  # any failure: fall back, say why, retry later
            self.state, self.why, self._failed_at = "down", _said(err), time.monotonic()
            return
        self.state, self.why = "ready", None
        self.build_ms = int((time.monotonic() - started) * 1000)

    async def _make(self) -> None:
        probe = (await self._embed([PROBE], BUILD_TIMEOUT_S))[0]
        digest = self._digest(probe)
        dim = len(probe)
        cached, problem = await asyncio.to_thread(self.cache.load, digest)
        if any(len(v) != dim for v in cached.values()):
            cached, problem = {}, f"{self.cache.path.name}: vectors of another size: rebuilt"
        keys = [example_key(digest, text) for _, text in self._examples]
        have = [i for i, key in enumerate(keys) if key in cached]
        if have:  # a cached vector is used only once a few of them are embedded again alike
            checked = have[:: max(1, len(have) // SPOT_CHECK)][:SPOT_CHECK]
            fresh = await self._embed([self._examples[i][1] for i in checked], BUILD_TIMEOUT_S)
            pairs = zip(checked, fresh, strict=True)
            if any(cosine(cached[keys[i]], v) < SPOT_MIN for i, v in pairs):
                cached, have = {}, []
                problem = f"{self.cache.path.name}: vectors that the member does not give: rebuilt"
        vectors = {keys[i]: cached[keys[i]] for i in have}
        missing = [i for i, key in enumerate(keys) if key not in vectors]
        for start in range(0, len(missing), BATCH):
            batch = missing[start : start + BATCH]
            texts = [self._examples[i][1] for i in batch]
            got = await self._embed(texts, BUILD_TIMEOUT_S)
            if any(len(v) != dim for v in got):
                raise EmbeddingError("the member's vectors changed size while building")
            vectors.update((keys[i], v) for i, v in zip(batch, got, strict=True))
        if missing or problem or len(cached) != len(vectors):
            await asyncio.to_thread(self.cache.save, digest, dim, vectors)
        raw = [vectors[key] for key in keys]
        mean = [math.fsum(column) / len(raw) for column in zip(*raw, strict=True)] if raw else []
        self._mean = mean or [0.0] * dim
        self._units = [_unit(v, self._mean) for v in raw]
        self.digest, self.problem = digest, problem
        self.reused, self.computed = len(have), len(missing)
        self._queries.clear()

    def _digest(self, probe: Sequence[float]) -> str:
        norm = math.sqrt(math.fsum(x * x for x in probe)) or 1.0
        shape = [round(x / norm, 2) for x in probe]
        identity = {**self._identity, "dim": len(probe), "probe": shape}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    # ---------------------------------------------------------------- routes

    async def compare(self, text: str, wait: float = 0.0) -> Likeness:
        """`text`'s likeness to every lane's examples, or why there is none. Never raises."""
        if not await self.ready(wait):
            why = self.why if self.state == "down" else "the example vectors are being built"
            return Likeness(member=self.member, used=False, why=f"{why}: keyword scores only")
        started = time.monotonic()
        vector = self._queries.get(text)
        ms = 0
        if vector is None:
            try:
                vector = (await self._embed([text], self.query_timeout_s))[0]
            except asyncio.CancelledError:
                raise
            except Exception as err:
                why = f"{_said(err)}: keyword scores only"
                return Likeness(member=self.member, used=False, why=why, digest=self.digest)
            ms = int((time.monotonic() - started) * 1000)
            if len(vector) != len(self._mean):
                return Likeness(
                    member=self.member,
                    used=False,
                    why="the request's vector is not the size of the examples' (another "
                    "model?): keyword scores only",
                    digest=self.digest,
                )
            self._queries[text] = vector
            while len(self._queries) > QUERIES:
                self._queries.popitem(last=False)
        self._queries.move_to_end(text)
        # ~500 examples x ~600 dimensions in Python: tens of ms, off the event loop
        best = await asyncio.to_thread(self._nearest, _unit(vector, self._mean))
        return Likeness(
            member=self.member,
            used=True,
            digest=self.digest,
            examples=len(self._units),
            lanes=best,
            ms=ms,
        )

    def _nearest(self, query: list[float]) -> dict[str, tuple[float, str]]:
        """Per lane, the centred cosine of its example nearest `query` (a unit vector), and
        that example; the examples' units were built from the same mean."""
        best: dict[str, tuple[float, str]] = {}
        units, examples = self._units, self._examples
        for (lane, example), unit in zip(examples, units, strict=True):
            value = sum(map(operator.mul, query, unit))
            if value > best.get(lane, (-2.0, ""))[0]:
                best[lane] = (round(value, 4), example)
        return best

    def close(self) -> None:
        """Stop a build in progress (the roster was reloaded, or the daemon stops)."""
        if self._build is not None and not self._build.done():
            self._build.cancel()

    async def aclose(self) -> None:
        self.close()
        if self._build is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._build

    def status(self) -> dict[str, Any]:
        """For `tally status` and doctor: the member, the state of its vectors and the cache."""
        return {
            "member": self.member,
            "state": self.state,
            "why": self.why,
            "examples": len(self._examples),
            "reused": self.reused,
            "computed": self.computed,
            "build_ms": self.build_ms,
            "cache": self.cache.path.name,
            "cache_problem": self.problem,
        }


def _lanes(roster: Roster) -> list[Lane]:
    return list(roster.lanes)


def _said(err: BaseException) -> str:
    message = getattr(err, "message", None) or str(err) or type(err).__name__
    if isinstance(err, TimeoutError):
        message = "the embedding member did not answer in time"
    return message if message.startswith("embeddings") else f"embedding member: {message}"


def of(roster: Roster, pool: EmbedPool, state_dir: Path) -> Embeddings | None:
    """The roster's embeddings, or None when `[policy] embeddings` names no member."""
    member = roster.policy.embeddings
    if member is None:
        return None
    return Embeddings(roster, member, pool, state_dir / "embeddings")
