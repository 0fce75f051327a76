"""The loop's messages, kept inside the member's context window.

The prefix is stable so the slot's prompt cache stays warm: the system prompt, the task, then
each step appended (the model's call, then its observation), never rewritten — until the
conversation would no longer fit in `n_ctx`. Then old observations (and the long arguments of
old calls, a write_file's content) are cut to a stub that says what was cut, oldest first,
down to `target` of the budget at once, so the cache is broken once per compaction and not
on every step. The system prompt, the task and the last `keep_last` steps are never cut.
Tokens are estimated (characters / 3.5, a little above what llama.cpp's tokenizers give for
code and English), which costs no request.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 3.5
MESSAGE_OVERHEAD = 8
"""Tokens a chat template adds around each message (role markers)."""


def estimate(text: str) -> int:
    return int(len(text) / CHARS_PER_TOKEN) + 1


@dataclass
class Message:
    body: dict[str, Any]
    step: int
    """0: system prompt and task (never cut)."""
    kind: str
    """"system", "task", "dropped" (the note of steps cut whole), "call", "observation",
    "nudge"."""
    tool: str | None = None
    cut: bool = False
    dropped: dict[str, int] = field(default_factory=dict)
    """On the note of dropped steps: how many calls of each tool it stands for."""

    counted: int | None = None
    """Its tokens, counted once (a message changes only when it is cut, or the note)."""

    def tokens(self) -> int:
        if self.counted is None:
            self.counted = estimate(json.dumps(self.body, ensure_ascii=False)) + MESSAGE_OVERHEAD
        return self.counted


@dataclass
class Conversation:
    n_ctx: int
    reserve: int
    """Tokens kept free: the step's completion plus the tool definitions (native mode)."""
    keep_last: int = 3
    target: float = 0.7
    messages: list[Message] = field(default_factory=list)
    cuts: int = 0

    def add(self, message: Message) -> None:
        self.messages.append(message)

    def wire(self) -> list[dict[str, Any]]:
        return [m.body for m in self.messages]

    def tokens(self) -> int:
        return sum(m.tokens() for m in self.messages)

    @property
    def budget(self) -> int:
        return self.n_ctx - self.reserve

    def fit(self) -> int:
        """Cut old steps until the conversation fits; returns how many messages were cut now.

        First old results (and long arguments) become stubs; if the stubs of a long loop
        still do not fit, the oldest steps go whole, and one note after the task says which.
        Raises ContextFull when the parts never cut do not fit on their own."""
        if self.tokens() <= self.budget:
            return 0
        goal = int(self.budget * self.target)
        protected = max((m.step for m in self.messages), default=0) - self.keep_last
        cut = 0
        total = self.tokens()
        for message in self.messages:
            if total <= goal:
                break
            if message.step == 0 or message.step > protected or message.cut:
                continue
            before = message.tokens()
            if _stub(message):
                cut += 1
                total -= before - message.tokens()
        # Stubs too add up over a long loop: the oldest steps go whole, but only as many as
        # must (a stub still tells the model what it did).
        while total > self.budget and (
            old := [m for m in self.messages if 0 < m.step <= protected]
        ):
            step = old[0].step
            gone = [m for m in old if m.step == step]
            self.messages = [m for m in self.messages if m not in gone]
            self._note([m.tool for m in gone if m.kind == "call"], step)
            cut += len(gone)
            total = self.tokens()
        self.cuts += cut
        if total > self.budget:
            raise ContextFull(
                f"the system prompt, the task and the last {self.keep_last} steps need about "
                f"{total} tokens, more than the {self.budget} the context leaves"
            )
        return cut

    def _note(self, tools: list[str | None], step: int) -> None:
        """The note after the task that says which steps are no longer shown."""
        note = next((m for m in self.messages if m.kind == "dropped"), None)
        if note is None:
            note = Message({"role": "user", "content": ""}, 0, "dropped")
            at = next(i for i, m in enumerate(self.messages) if m.kind == "task") + 1
            self.messages.insert(at, note)
        counts = note.dropped
        for tool in tools:
            counts[tool or "malformed reply"] = counts.get(tool or "malformed reply", 0) + 1
        note.counted = None
        done = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
        note.body["content"] = (
            f"[cut to save context: steps 1-{step} are no longer shown ({done}); "
            "the files they touched are as those steps left them]"
        )


class ContextFull(Exception):
    pass


def _stub(message: Message) -> bool:
    """Cut a message in place; False if there is nothing worth cutting."""
    message.counted = None
    body = message.body
    if message.kind in ("observation", "nudge"):
        text = str(body.get("content") or "")
        if len(text) <= 200:
            return False
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        body["content"] = (
            f"[cut to save context: the {message.tool or 'tool'} result of step {message.step}, "
            f"{len(text):,} characters (sha256 {digest}…); call the tool again if you need it]"
        )
        message.cut = True
        return True
    if message.kind == "call":
        changed = False
        if isinstance(body.get("content"), str) and len(body["content"]) > 200:
            body["content"] = _shorten_text_call(body["content"])
            changed = True
        for call in body.get("tool_calls") or ():
            function = call.get("function") or {}
            raw = function.get("arguments")
            if isinstance(raw, str) and len(raw) > 200:
                function["arguments"] = _shorten_arguments(raw)
                changed = True
        message.cut = changed
        return changed
    return False


def _shorten_arguments(raw: str) -> str:
    try:
        return json.dumps(_shorten(json.loads(raw)), ensure_ascii=False)
    except (ValueError, RecursionError):  # a model's arguments may nest past json's limit
        return json.dumps({"cut": f"{len(raw)} characters of arguments"})


def _shorten_text_call(text: str) -> str:
    try:
        return json.dumps(_shorten(json.loads(text)), ensure_ascii=False)
    except (ValueError, RecursionError):  # a model's reply may nest past json's limit
        return f"[cut: {len(text):,} characters of an old reply]"


def _shorten(value: Any) -> Any:
    if isinstance(value, str) and len(value) > 120:
        return f"[cut: {len(value):,} characters]"
    if isinstance(value, dict):
        return {k: _shorten(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shorten(v) for v in value]
    return value
