"""The `agent` executor's loop: ask for one tool call, run it, show the model what it did.

    result = await run_agent(instruction, view, lease_factory, witness, checks=..., limits=...)

Each step leases a slot (`lease_factory`: the engine passes the pool's lease with the task's
affinity, so the same slot comes back and its prompt cache with it), sends the conversation
(a stable prefix: system prompt, task, then the steps appended), reads one call back (native
`tool_calls`, or the `response_format`-constrained JSON), runs it, and witnesses an
`agent.step` (`record.AgentStep`) whose parent is the previous step. The slot is not held
while a tool runs: a test suite that takes a minute does not keep other tasks off the model.

Guardrails, each ending the loop with its own `AgentResult.outcome`:
- a malformed reply is rescue-parsed (`calls.rescue`); if that fails, the model is told the
  exact error (a nudge), at most `nudges` times in a row ("malformed");
- the same call with the same arguments `repeats` times with nothing written in between
  ("stuck");
- `max_steps` model calls ("steps"), `tokens` prompt + completion tokens ("tokens"), `wall_s`
  seconds ("wall"), and the caller's `reserve` (the run's budget: it raises, and the error
  propagates as it does for any model call);
- `finish` is accepted only once `checks` pass ("finished"); otherwise their output is the
  next observation;
- the conversation is compacted to fit `n_ctx` (`conversation`); if the parts never cut do not
  fit, the loop ends ("context").
A server that refuses native tools (a llama.cpp started without `--jinja`) on the first step
moves the loop to json mode, which every llama.cpp server can follow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from daemon.record import Body
from daemon.runs import entries as k
from daemon.runs.agent import calls
from daemon.runs.agent.calls import Call, Malformed, Mode
from daemon.runs.agent.conversation import ContextFull, Conversation, Message, estimate
from daemon.runs.agent.paths import DEFAULT_HIDDEN, Jail
from daemon.runs.agent.record import AgentStep, Outcome, StepTimings, StepTokens
from daemon.runs.agent.toolbox import TOOLS, Observation, Runner, Toolbox, ToolLimits
from daemon.runs.executors import CommandOutcome, run_command
from daemon.runs.ports import LeasePort, SentReply
from daemon.runs.sandbox import Confinement
from daemon.slots.errors import ModelError
from daemon.slots.records import ledger_timings
from roster.models import CommandPolicy

End = Literal["finished", "stuck", "malformed", "steps", "tokens", "wall", "context"]
REPLY_CHARS = 4000
"""Characters of a reply kept in its step (and in the conversation)."""


AgentReply = SentReply
"""What a chat request returns, as the loop reads it (the pool's `Completion`)."""
AgentLease = LeasePort
"""One leased slot: the engine's lease port serves the loop too (`request`, then `send`)."""


LeaseFactory = Callable[[], AbstractAsyncContextManager[AgentLease]]
StepWitness = Callable[[Body, int | None], Awaitable[int]]
"""(body, parent) -> the entry's seq: the engine's `witness` with the run id bound."""
Checks = Callable[[], Awaitable[tuple[bool, str]]]
"""The task's checks on the view as it is now: (passed, their output)."""


@dataclass(frozen=True)
class AgentLimits:
    max_steps: int = 30
    tokens: int | None = None
    """Prompt + completion tokens of every step together (None: only the run's budget)."""
    wall_s: float = 600.0
    step_tokens: int = 768
    """A step's completion tokens (`max_tokens` of each request)."""
    n_ctx: int = 4096
    """The slot's context window, in tokens."""
    nudges: int = 3
    """Malformed replies in a row that are answered with a nudge; one more ends the loop."""
    repeats: int = 3
    keep_last: int = 3
    """Steps at the end of the conversation that compaction never cuts."""
    tools: ToolLimits = field(default_factory=ToolLimits)


@dataclass
class AgentResult:
    outcome: End
    summary: str | None
    """The accepted finish's summary (outcome "finished")."""
    steps: int
    tokens: int
    mode: Mode
    last_seq: int | None
    """The last agent.step witnessed (the task's result hangs off it)."""
    error: str | None = None
    """Why the loop ended, for every outcome but "finished"."""


def sandboxed(
    view: Path,
    *,
    policy: CommandPolicy | None = None,
    confinement: Confinement | None = None,
    timeout_s: float = 60.0,
    network: bool = False,
) -> Runner:
    """The `run` tool's runner: the command executor's sandbox with the view as working dir
    (its only writable path), with the task's limits (the policy's rlimits, the timeout)."""

    async def run(argv: list[str]) -> CommandOutcome:
        return await run_command(
            argv,
            policy=policy,
            confinement=confinement,
            network=network,
            timeout_s=timeout_s,
            workdir=view,
        )

    return run


JSON_TEMPERATURE = 0.0
"""The highest temperature of a json-mode step: the grammar holds the shape, and a small model
picks its tool and arguments best greedily (the member's own sampling is for prose)."""
OVERVIEW_FILES = 30
"""A view with at most this many files is listed in the task message (no list_files step)."""


def _arguments(model: type[Any]) -> str:
    """A tool's arguments as the model writes them: required ones bare, optional ones with '?'."""
    return ", ".join(
        f'"{name}"' + ("" if info.is_required() else "?")
        for name, info in model.model_fields.items()
    )


_JSON_FORMAT = (
    'Reply with exactly one JSON object and nothing else: {"tool": "<name>", "arguments": {...}}'
)
_JSON_EXAMPLE = (
    "For example, the task 'Create the file NAME containing TEXT.' takes these calls:\n"
    '{"tool": "write_file", "arguments": {"path": "NAME", "content": "TEXT"}}\n'
    '{"tool": "finish", "arguments": {"summary": "Created NAME."}}\n'
    "with NAME and TEXT taken from the task."
)


def system_prompt(mode: Mode) -> str:
    """The tool instructions: short, since a small model reads every token of them each step.

    In json mode each tool shows the keys of its arguments, and a worked example (not any
    task's answer) shows the call format and the end of a task: a write, then finish."""
    lines = [
        "You are a careful software engineer working on a project through tools.",
        "Each reply is exactly one tool call. Paths are relative to the project root.",
        "Tools:",
    ]
    for name, model in TOOLS.items():
        doc = (model.__doc__ or "").strip()
        if mode == "json":
            lines.append(f"- {name} {{{_arguments(model)}}}: {doc}")
        else:
            lines.append(f"- {name}({', '.join(model.model_fields)}): {doc}")
    lines.append("Do only what the task asks; call finish as soon as it is done.")
    if mode == "json":
        lines += [_JSON_FORMAT, _JSON_EXAMPLE]
    return "\n".join(lines)


def _clean(value: Any) -> Any:
    """Strings as UTF-8 can hold them (a lone surrogate from a JSON escape becomes '?')."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_clean(key): _clean(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_clean(item) for item in value]
    return value


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 14] + "\n…[truncated]"


class _Loop:
    def __init__(
        self,
        *,
        instruction: str,
        toolbox: Toolbox,
        lease_factory: LeaseFactory,
        witness: StepWitness,
        checks: Checks | None,
        limits: AgentLimits,
        mode: Mode,
        system: str | None,
        task: str | None,
        parent: int | None,
        reserve: Callable[[], None] | None,
        overview: list[str] | None = None,
    ) -> None:
        self.toolbox = toolbox
        self.lease_factory = lease_factory
        self.witness = witness
        self.checks = checks
        self.limits = limits
        self.mode: Mode = mode
        self.task = task
        self.last_seq = parent
        self.reserve = reserve
        self.tokens = 0
        self.step = 0
        self.seen: Counter[tuple[str, str, int]] = Counter()
        self.malformed = 0
        self.began = time.monotonic()
        self.specs = calls.tool_specs()
        self.conversation = Conversation(
            n_ctx=limits.n_ctx, reserve=self._reserve_tokens(), keep_last=limits.keep_last
        )
        intro = (system + "\n\n" if system else "") + system_prompt(mode)
        self.conversation.add(Message({"role": "system", "content": intro}, 0, "system"))
        finish = " It is accepted once the task's checks pass." if checks is not None else ""
        # The task comes last, quoted, right before the reply: a small model follows what it
        # read last (measured with SmolLM2-135M: the task first, its content ran on into the
        # file names after it).
        parts = []
        if overview is not None:  # a small view, shown whole: no step spent listing it
            parts.append("The project's files:\n" + ("\n".join(overview) or "(none yet)"))
        parts.append(
            "The project is the current directory. Do the task with the tools, then call "
            f"finish with a short summary.{finish}"
        )
        parts.append(f'Task: "{instruction}"')
        task_text = "\n\n".join(parts)
        self.conversation.add(Message({"role": "user", "content": task_text}, 0, "task"))

    def _reserve_tokens(self) -> int:
        specs = estimate(json.dumps(self.specs)) if self.mode == "native" else 0
        return self.limits.step_tokens + specs + 64

    def result(self, outcome: End, error: str | None, summary: str | None = None) -> AgentResult:
        return AgentResult(
            outcome=outcome,
            summary=summary,
            steps=self.step,
            tokens=self.tokens,
            mode=self.mode,
            last_seq=self.last_seq,
            error=error,
        )

    async def run(self) -> AgentResult:
        limits = self.limits
        deadline = time.monotonic() + limits.wall_s
        while True:
            if self.step >= limits.max_steps:
                return self.result("steps", f"no finish within {limits.max_steps} steps")
            if limits.tokens is not None and self.tokens >= limits.tokens:
                return self.result("tokens", f"{self.tokens} tokens used of {limits.tokens}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self.result("wall", f"the loop ran past {limits.wall_s:g} s")
            self.began = time.monotonic()
            try:
                compacted = self.conversation.fit()
            except ContextFull as err:
                return self.result("context", str(err))
            clock = asyncio.timeout(remaining)
            try:
                async with clock:
                    ended = await self._step(compacted)
            except TimeoutError:
                if not clock.expired():  # a timeout of something else (a server's hang)
                    raise
                return self.result("wall", f"the loop ran past {limits.wall_s:g} s")
            if ended is not None:
                return ended

    async def _ask(self) -> tuple[AgentReply, AgentLease, int]:
        """One model call on a leased slot: (reply, the lease it ran on, microseconds)."""
        started = time.monotonic()
        async with self.lease_factory() as lease:
            while True:
                body = lease.request(
                    self.conversation.wire(),
                    self.limits.step_tokens,
                    calls.response_format() if self.mode == "json" else None,
                )
                if self.mode == "json":
                    body["temperature"] = min(
                        float(body.get("temperature", JSON_TEMPERATURE)), JSON_TEMPERATURE
                    )
                if self.mode == "native":
                    body["tools"] = self.specs
                    body["tool_choice"] = "required"
                    body["parallel_tool_calls"] = False
                try:
                    reply = await lease.send(body)
                except ModelError as err:
                    # A server that cannot take tools says so on the first request: json mode.
                    if self.mode != "native" or self.step > 1 or not 400 <= err.status_code < 500:
                        raise
                    self._to_json()
                    continue
                return reply, lease, int((time.monotonic() - started) * 1_000_000)

    def _to_json(self) -> None:
        self.mode = "json"
        system = self.conversation.messages[0].body
        system["content"] = "\n".join([str(system["content"]), _JSON_FORMAT, _JSON_EXAMPLE])
        self.conversation.messages[0].counted = None
        self.conversation.reserve = self._reserve_tokens()

    async def _step(self, compacted: int) -> AgentResult | None:
        self.step += 1
        if self.reserve is not None:
            self.reserve()
        reply, lease, model_us = await self._ask()
        usage = reply.usage
        self.tokens += usage.prompt_tokens + usage.completion_tokens
        text = reply.text or ""
        where = {"member": lease.member, "instance": lease.instance, "slot": lease.id_slot}
        tokens = StepTokens(
            prompt=usage.prompt_tokens,
            completion=usage.completion_tokens,
            cached=usage.cached_tokens,
        )
        server = ledger_timings(reply.timings)
        try:
            if self.mode == "native":
                call = calls.from_native(list(reply.tool_calls or []), text)
            else:
                call = calls.from_text(text)
            call = calls.check(dataclasses.replace(call, arguments=_clean(call.arguments)))
        except Malformed as err:
            return await self._malformed(str(err), text, tokens, model_us, server, where, compacted)
        self.malformed = 0
        arguments = TOOLS[call.tool].model_validate(call.arguments).model_dump()
        key = (call.tool, json.dumps(arguments, sort_keys=True), self.toolbox.writes)
        self.seen[key] += 1
        started = time.monotonic()
        end: AgentResult | None = None
        outcome: Outcome
        if self.seen[key] >= self.limits.repeats:
            observation = (
                f"the same {call.tool} call was made {self.seen[key]} times with nothing changed "
                "in between: the loop stops as stuck"
            )
            outcome = "stuck"
            end = self.result("stuck", observation)
        elif call.tool == "finish":
            observation, outcome, end = await self._finish(str(arguments["summary"]))
        else:
            seen: Observation = await self.toolbox.use(
                call.tool, arguments, thread=asyncio.to_thread
            )
            observation, outcome = seen.text, "ok" if seen.ok else "error"
        if call.extra:
            observation = (
                f"[only the first tool call of a reply is run: {call.extra} more were not]\n"
                + observation
            )
        tool_us = int((time.monotonic() - started) * 1_000_000)
        self._remember(call, arguments, text, observation)
        await self._witness(
            tool=call.tool,
            arguments=arguments,
            parse=call.parse,
            outcome=outcome,
            reply=text,
            observation=observation,
            tokens=tokens,
            timings=StepTimings(model_us=model_us, tool_us=tool_us, server=server),
            where=where,
            compacted=compacted,
        )
        if end is not None:
            end.last_seq = self.last_seq
        return end

    async def _finish(self, summary: str) -> tuple[str, Outcome, AgentResult | None]:
        if self.checks is None:
            return "finished", "finished", self.result("finished", None, summary)
        passed, output = await self.checks()
        output = _clip(output, self.limits.tools.run_output)
        if passed:
            return (
                f"the checks pass: finished\n{output}",
                "finished",
                self.result("finished", None, summary),
            )
        return (
            "finish refused: the task's checks fail:\n"
            + output
            + "\nDo not call finish again yet: first change the files (write_file or edit) so "
            "that the checks pass.",
            "finish_refused",
            None,
        )

    async def _malformed(
        self,
        error: str,
        text: str,
        tokens: StepTokens,
        model_us: int,
        server: dict[str, int],
        where: dict[str, Any],
        compacted: int,
    ) -> AgentResult | None:
        self.malformed += 1
        hint = (
            'one JSON object {"tool": "<name>", "arguments": {...}}'
            if self.mode == "json"
            else "one call of one of the tools"
        )
        nudge = f"Your reply was not a valid tool call: {error}. Reply with exactly {hint}."
        self.conversation.add(
            Message({"role": "assistant", "content": _clip(text, REPLY_CHARS)}, self.step, "call")
        )
        self.conversation.add(
            Message({"role": "user", "content": nudge}, self.step, "nudge", tool=None)
        )
        await self._witness(
            tool=None,
            arguments={},
            parse="malformed",
            outcome="malformed",
            reply=text,
            observation=nudge,
            tokens=tokens,
            timings=StepTimings(model_us=model_us, server=server),
            where=where,
            compacted=compacted,
        )
        if self.malformed > self.limits.nudges:
            return self.result(
                "malformed", f"{self.malformed} malformed replies in a row; the last: {error}"
            )
        return None

    def _remember(self, call: Call, arguments: dict[str, Any], text: str, observation: str) -> None:
        """The step in the conversation, appended (the prefix before it never changes)."""
        if self.mode == "native":
            call_id = call.id or f"call_{self.step}"
            said: dict[str, Any] = {
                "role": "assistant",
                "content": _clip(text, REPLY_CHARS) if text.strip() else None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": call.tool,
                            "arguments": json.dumps(arguments, ensure_ascii=False),
                        },
                    }
                ],
            }
            shown: dict[str, Any] = {"role": "tool", "tool_call_id": call_id}
            shown["content"] = observation
        else:
            said = {"role": "assistant", "content": _clip(text, REPLY_CHARS)}
            shown = {"role": "user", "content": f"[{call.tool} result]\n{observation}"}
            if call.tool in ("write_file", "edit"):
                # Said to the model only (the step's observation is the tool's own): a small
                # model otherwise writes the same file again instead of finishing.
                shown["content"] += "\nIf that completes the task, call finish now."
        self.conversation.add(Message(said, self.step, "call", tool=call.tool))
        self.conversation.add(Message(shown, self.step, "observation", tool=call.tool))

    async def _witness(
        self,
        *,
        tool: str | None,
        arguments: dict[str, Any],
        parse: Any,
        outcome: Outcome,
        reply: str,
        observation: str,
        tokens: StepTokens,
        timings: StepTimings,
        where: dict[str, Any],
        compacted: int,
    ) -> None:
        observation = _clean(observation)
        timings.step_us = int((time.monotonic() - self.began) * 1_000_000)
        body = AgentStep(
            task=self.task,
            step=self.step,
            mode=self.mode,
            tool=tool,
            arguments=k.safe(arguments),
            parse=parse,
            outcome=outcome,
            reply=_clean(_clip(reply, REPLY_CHARS)),
            observation=observation,
            observation_sha256=hashlib.sha256(observation.encode()).hexdigest(),
            tokens=tokens,
            timings=timings,
            compacted=compacted,
            **where,
        )
        self.last_seq = await self.witness(body, self.last_seq)


async def run_agent(
    instruction: str,
    view: Path,
    lease_factory: LeaseFactory,
    witness: StepWitness,
    *,
    checks: Checks | None = None,
    limits: AgentLimits | None = None,
    runner: Runner | None = None,
    mode: Mode = "json",
    system: str | None = None,
    hidden: Sequence[str] = DEFAULT_HIDDEN,
    task: str | None = None,
    parent: int | None = None,
    reserve: Callable[[], None] | None = None,
) -> AgentResult:
    """Run the tool loop on `view` until `finish` is accepted or a guardrail ends it.

    `runner` runs the `run` tool's argv (`sandboxed(view, …)`; None: `run` is refused).
    `mode` "native" asks for OpenAI tool calls (see `calls.native_supported` on the member's
    `/props`), "json" for the schema-constrained call. `system` is the lane's system prompt
    (the tool instructions follow it). `task` names the task in each step; `parent` is the
    first step's parent (task.start). `reserve` is called before each model call (the run's
    `Meter.reserve_call`): what it raises propagates. Model errors propagate too.

    The engine's wiring is `daemon.runs.agent.executor` (a task with `"executor": "agent"`);
    in short:

        result = await run_agent(
            task.instruction, view.path,
            lambda: s.pool.lease(tier, affinity=f"{run.id}/{task.id}"),
            functools.partial(s.witness, run.id),
            checks=..., runner=sandboxed(view.path, policy=policy,
                                         confinement=s.options.confinement, timeout_s=...),
            limits=AgentLimits(n_ctx=<the member's n_ctx per slot>, ...),
            mode="native" if native_supported(props) else "json",
            system=lane.system, task=task.id, parent=start_seq, reserve=run.meter.reserve_call,
        )
    """
    limits = limits or AgentLimits()
    toolbox = Toolbox(Jail.of(view, hidden), runner, limits.tools)
    overview = await asyncio.to_thread(toolbox.overview, OVERVIEW_FILES)
    loop = _Loop(
        instruction=instruction,
        toolbox=toolbox,
        lease_factory=lease_factory,
        witness=witness,
        checks=checks,
        limits=limits,
        mode=mode,
        system=system,
        task=task,
        parent=parent,
        reserve=reserve,
        overview=overview,
    )
    return await loop.run()
