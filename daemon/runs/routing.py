"""A run's route: the lane its request goes to (the step; the keyword router is `daemon.router`).

Input: a run whose request is witnessed (its view's `request_seq`). Output: (lane, seq), the
seq being the entry the plan hangs off. Witnessed:
- `run.embedding` (parent: the request) when the roster names an embedding member: what it
  compared, the nearest example's cosine per lane, or why it was not used (down, building);
  `run.route` then names it (`embedding`: its seq);
- `run.route` (parent: the request) always — the client's lane (source "client", with the
  router's scores and its own choice beside it under `router`), or the router's scores,
  confidence and deciding words (source "router");
- `run.classify` when the router escalates (no lane, or too close to call) and the client gave
  no plan: what the route's `decision` says (`daemon.router.decide`, the one `tally route`
  shows): the classifier's choice among the best-scoring few lanes plus `general` (parent: its
  last reply), or, with no classifier or no lane's evidence over the floor, the best score /
  `general` without a model call. A failed classifier falls back to the best score, with its
  error.
Guarantees: the lane returned is one of the roster's lanes, except that a client's plan with
an escalating route keeps the router's lane (or the plan's first task's) — its lanes decide.
"""

from __future__ import annotations

import asyncio
from typing import Any

from daemon import record as rec
from daemon import router
from daemon.runs.budget import BudgetExhausted
from daemon.runs.calls import structured
from daemon.runs.context import Run, Setting, describe
from daemon.runs.ports import DecisionLike, EmbeddingRouter, RouteResult

GENERAL = router.GENERAL
CANDIDATES = router.CANDIDATES


async def route(s: Setting, run: Run) -> tuple[str, int]:
    view = s.views[run.id]
    router = s.router
    decided: RouteResult
    embedded: int | None = None
    if isinstance(router, EmbeddingRouter):
        decided = await router.aroute(view.request)
        likeness = getattr(decided, "embedding", None)
        if likeness is not None:  # the embedding member's part, before the route it fed
            embedded = await s.witness(run.id, embedding_body(likeness), view.request_seq)
    else:
        decided = router.route(view.request)
    scores = [[lane, _ppm(score)] for lane, score in list(decided.scores)[:8]]
    matched = {lane: list(words) for lane, words in dict(decided.matched).items()}
    if view.lane is not None:
        # The client named the lane: witnessed with the router's own choice beside it, so an
        # override is a correction the record keeps (`tally route --suggest` reads them).
        body = rec.RunRoute(
            lane=view.lane,
            confidence_ppm=1_000_000,
            escalate=False,
            source="client",
            scores=scores,
            matched=matched,
            router=_choice(decided.decision),
        )
        if embedded is not None:  # only with an embedding member: older routes unchanged
            body.embedding = embedded
        return view.lane, await s.witness(run.id, body, view.request_seq)
    body = rec.RunRoute(
        lane=decided.lane,
        confidence_ppm=_ppm(decided.confidence),
        escalate=bool(decided.escalate),
        source="router",
        scores=scores,
        matched=matched,
    )
    if embedded is not None:
        body.embedding = embedded
    seq = await s.witness(run.id, body, view.request_seq)
    if decided.lane is not None and not decided.escalate:
        return str(decided.lane), seq
    if run.client_plan is not None:  # the client planned: its lanes decide, no model call
        return str(decided.lane or run.client_plan.tasks[0].lane), seq
    # What the route said submit would do (`Route.decision`, the same one `route` shows).
    decision = decided.decision
    if decision.source == "classifier" and decision.classifier is not None:
        return await _classify(s, run, decision.classifier, list(decision.candidates), seq)
    lane = str(decision.lane)
    ranked = [name for name, score in decided.scores if name in s.lanes]
    candidates = ranked[:CANDIDATES]
    if GENERAL in s.lanes and GENERAL not in candidates:
        candidates.append(GENERAL)
    chosen = rec.RunClassify(lane=lane, candidates=candidates, source=decision.source, error=None)
    return lane, await s.witness(run.id, chosen, seq)


def embedding_body(likeness: Any) -> rec.RunEmbedding:
    """What the embedding member said of a request (`daemon.embeddings.Likeness`), as the
    `run.embedding` entry and the `route.preview` hold it (no floats: cosines in ppm)."""
    return rec.RunEmbedding(
        member=likeness.member,
        used=likeness.used,
        why=likeness.why,
        digest=likeness.digest,
        examples=likeness.examples,
        ms=likeness.ms,
        nearest=[[lane, _ppm(value), text] for lane, value, text in likeness.top()],
    )


def _choice(decision: DecisionLike) -> rec.RouterChoice:
    """The router's decision as a witnessed body holds it."""
    return rec.RouterChoice(
        lane=decision.lane,
        source=decision.source,
        classifier=decision.classifier,
        candidates=list(decision.candidates),
    )


async def _classify(
    s: Setting, run: Run, classifier: str, candidates: list[str], parent: int
) -> tuple[str, int]:
    """The classifier model picks one of the few best-scoring lanes (or `general`)."""
    view = s.views[run.id]
    fallback = candidates[0]
    schema = {
        "type": "object",
        "properties": {"lane": {"type": "string", "enum": candidates}},
        "required": ["lane"],
        "additionalProperties": False,
    }
    described = "\n".join(
        f"- {name}: {s.lanes[name].system.splitlines()[0][:160]}" for name in candidates
    )
    messages = [
        {
            "role": "system",
            "content": "You route a request to the one lane best suited to it. "
            'Reply with only JSON: {"lane": "<name>"}.',
        },
        {"role": "user", "content": f"Lanes:\n{described}\n\nRequest:\n{view.request}"},
    ]

    def valid(value: Any) -> str:
        lane = value.get("lane") if isinstance(value, dict) else None
        if lane not in candidates:
            raise ValueError(f"lane must be one of {', '.join(candidates)}")
        return str(lane)

    lane, source, error, reply_seq = fallback, "fallback", None, None
    try:
        got = await structured(s, run, "classify", classifier, messages, schema, valid, parent)
        lane, source, reply_seq = got.value, "model", got.reply_seq
    except (BudgetExhausted, asyncio.CancelledError):
        raise
    except Exception as exc:  # the classifier is advice: fall back to the best score
        error = describe(exc)
    body = rec.RunClassify(lane=lane, candidates=candidates, source=source, error=error)
    return lane, await s.witness(run.id, body, reply_seq or parent)


def _ppm(value: Any) -> int:
    return round(float(value) * 1_000_000)
