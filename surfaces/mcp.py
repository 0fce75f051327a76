"""`tally mcp`: the MCP stdio adapter an IDE launches (official SDK v2, low-level Server).

`tools/list` comes from `daemon.tools.TOOLS` with exactly the schemas HTTP publishes;
`tools/call` is forwarded to the running daemon. `submit` follows the run's SSE events and
reports progress; an MCP cancellation cancels the run. Nothing but the protocol goes to stdout.

Only the SDK is loaded before `initialize` is answered: the tool registry (pydantic models,
schemas) loads with the first `tools/list` or `tools/call`, the HTTP client (aiohttp) with the
first call, so an IDE sees the server up in about the SDK's own import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from daemon.version import package_version

if TYPE_CHECKING:
    from daemon.tools import ProgressSteps, RunOut
    from surfaces.client import DaemonClient

log = logging.getLogger("tally.mcp")


def _error(message: str, details: Any = None) -> types.CallToolResult:
    text = message if not details else f"{message}\n{json.dumps(details, indent=1)}"
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


def _ok(body: dict[str, Any]) -> types.CallToolResult:
    text = json.dumps(body, ensure_ascii=False)
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], structured_content=body
    )


DESTRUCTIVE = frozenset(
    {"run_cancel", "run_apply", "ledger_redact", "roster_reload", "client_revoke"}
)
"""Tools whose effect cannot be taken back (MCP's destructiveHint)."""


class Adapter:
    """Forwards MCP tool calls to the daemon; one keep-alive HTTP session for the process."""

    def __init__(self, socket_path: Path | None = None, *, autostart: bool = False) -> None:
        self.socket_path = socket_path
        self.autostart = autostart
        self._started: subprocess.Popen[bytes] | None = None
        self._client: DaemonClient | None = None
        self._tools: list[types.Tool] | None = None

    @property
    def client(self) -> DaemonClient:
        if self._client is None:
            from surfaces.client import DaemonClient, Endpoint

            self._client = DaemonClient(Endpoint.from_env(self.socket_path))
        return self._client

    @property
    def tools(self) -> list[types.Tool]:
        if self._tools is None:
            from surfaces.routes import tool_listing

            self._tools = [
                types.Tool(
                    name=t["name"],
                    description=t["description"],
                    input_schema=t["input_schema"],
                    output_schema=t["output_schema"],
                    annotations=types.ToolAnnotations(
                        read_only_hint=t["scope"] == "read",
                        destructive_hint=t["name"] in DESTRUCTIVE,
                    ),
                    meta={"tally/scope": t["scope"]},
                )
                for t in tool_listing()
            ]
        return self._tools

    def server(self) -> Server[Any]:
        return Server(
            "tally",
            version=package_version(),
            instructions="tally runs requests through a fleet of local model agents and keeps "
            "a verifiable ledger of every step. Use `submit` with wait=true to get work done, "
            "`route` to preview routing, the ledger_* tools to audit.",
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
        )

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools)

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        from daemon.tools import TOOLS
        from surfaces.client import DaemonDown, DaemonError, not_running

        tool = TOOLS.get(params.name)
        if tool is None:  # a protocol error (the spec's -32602), not a tool's failed call
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}; see tools/list")
        arguments = dict(params.arguments or {})
        try:
            tool.input.model_validate(arguments)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
            return _error(f"invalid arguments for {params.name}", errors)
        try:
            if params.name == "submit" and arguments.get("wait"):
                body = await self._submit_and_follow(ctx, arguments)
            else:
                body = await self._call(params.name, arguments)
        except DaemonDown as exc:
            return _error(
                f"{not_running()}. Looked for it at {exc.where}; if it listens elsewhere, set "
                "TALLY_SOCKET (or TALLY_URL and TALLY_TOKEN) in this MCP server's env."
            )
        except DaemonError as exc:
            return _error(f"{exc.code}: {exc.message}", exc.details)
        return _ok(body)

    async def _call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        from surfaces.client import DaemonDown

        try:
            return await self.client.call(name, arguments)
        except DaemonDown:
            if not self.autostart or not await self._start_daemon():
                raise
            return await self.client.call(name, arguments)

    async def _submit_and_follow(
        self, ctx: ServerRequestContext[Any], arguments: dict[str, Any]
    ) -> dict[str, Any]:
        from daemon.runs.state import FINAL
        from daemon.tools import ProgressSteps, RunOut
        from surfaces.client import DaemonDown, DaemonError

        timeout = float(arguments.pop("timeout_s", 120.0))
        arguments["wait"] = False
        run = RunOut.model_validate(await self._call("submit", arguments))
        steps = ProgressSteps()
        await self._report(ctx, steps, run)
        written: dict[str | None, str] = {}  # streamed text per task, shown at most twice a second
        shown = 0.0
        try:
            # The stream is read behind the run (a loaded machine, a slow IDE): when `run_get`
            # says the run ended, the events still queued are older than that, so following
            # stops there and the final state is the last progress message.
            with anyio.move_on_after(timeout):
                async with contextlib.aclosing(self.client.events(run.id)) as events:
                    async for event in events:
                        if event.event == "delta":
                            data = event.data if isinstance(event.data, dict) else {}
                            task = data.get("task")
                            written[task] = written.get(task, "")[-400:] + str(data.get("text", ""))
                            if time.monotonic() - shown >= DELTA_EVERY_S:
                                shown = time.monotonic()
                                await ctx.session.report_progress(
                                    *steps.tokens(task, written[task])
                                )
                            continue
                        if event.event == "agent.step" and isinstance(event.data, dict):
                            await ctx.session.report_progress(*steps.agent_step(event.data))
                        run = RunOut.model_validate(
                            await self.client.call("run_get", {"run_id": run.id})
                        )
                        await self._report(ctx, steps, run)
                        if run.state in FINAL:
                            break
        except asyncio.CancelledError:
            # The IDE cancelled the call (or the link broke): the run must not go on unattended.
            with anyio.move_on_after(5, shield=True):
                try:
                    await self.client.call("run_cancel", {"run_id": run.id})
                except (DaemonDown, DaemonError) as exc:
                    log.info("cancel of %s after abandon: %s", run.id, exc)
            raise
        final = await self.client.call("run_get", {"run_id": run.id})
        # the last message says where the run is, whatever the stream's last event was
        await self._report(ctx, steps, RunOut.model_validate(final))
        return final

    @staticmethod
    async def _report(ctx: ServerRequestContext[Any], steps: ProgressSteps, run: RunOut) -> None:
        report = steps.next(run)
        if report is not None:
            await ctx.session.report_progress(*report)

    async def _start_daemon(self) -> bool:
        if self._started is None:
            argv = [sys.executable, "-m", "surfaces", "serve"]
            if self.client.endpoint.socket_path is not None:  # listen where we will look
                argv += ["--socket", str(self.client.endpoint.socket_path)]
            log.info("starting a daemon: %s", " ".join(argv))
            self._started = subprocess.Popen(  # noqa: ASYNC220 - detached, returns at once
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        for _ in range(100):
            if await self.client.ping():
                return True
            if self._started.poll() is not None:
                return False
            await asyncio.sleep(0.1)
        return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


DELTA_EVERY_S = 0.5
"""How often streamed tokens become a progress message (an IDE need not redraw per token)."""


class Lines:
    """The stdio transport's read side, answering every line that is not a JSON-RPC message.

    The SDK's transport turns such a line into an Exception item, which its dispatcher only
    logs at debug level, so the client would wait for an answer forever. JSON-RPC 2.0 wants
    -32700 (Parse error) for invalid JSON and -32600 (Invalid Request) for JSON that is not a
    message, both with id null.
    """

    def __init__(self, inner: Any, write: Any) -> None:
        self._inner = inner
        self._write = write

    @property
    def last_context(self) -> Any:  # the SDK restores each message's sender context from it
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        while True:
            item: SessionMessage | Exception = await self._inner.receive()
            if not isinstance(item, Exception):
                return item
            await self._answer(item)

    async def _answer(self, exc: Exception) -> None:
        invalid_json = isinstance(exc, ValidationError) and any(
            e["type"] == "json_invalid" for e in exc.errors()
        )
        code, message = (
            (types.PARSE_ERROR, "Parse error")
            if invalid_json
            else (types.INVALID_REQUEST, "Invalid Request")
        )
        log.warning("stdin: %s (%s)", message.lower(), type(exc).__name__)
        error = types.JSONRPCError(
            jsonrpc="2.0", id=None, error=types.ErrorData(code=code, message=message)
        )
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            await self._write.send(SessionMessage(error))

    def __aiter__(self) -> Lines:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> Lines:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        return None


async def run_stdio(socket_path: Path | None = None, *, autostart: bool = False) -> None:
    """Serve MCP on stdio, forwarding to the daemon at `socket_path` (else `Endpoint.from_env`)."""
    adapter = Adapter(socket_path, autostart=autostart)
    server = adapter.server()
    terminated = anyio.Event()
    try:
        async with stdio_server() as (read, write):
            lines = Lines(read, write)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_stop_on_sigterm, tg.cancel_scope, terminated)
                await server.run(lines, write, server.create_initialization_options())
                tg.cancel_scope.cancel()
            if terminated.is_set():
                # The calls are cancelled (the session's handlers ran their cleanup): die of
                # the signal as before, here, since leaving stdio_server would wait for its
                # reader thread, blocked in a read of stdin until the client closes it.
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.raise_signal(signal.SIGTERM)
    finally:
        await adapter.close()


async def _stop_on_sigterm(scope: anyio.CancelScope, terminated: anyio.Event) -> None:
    """SIGTERM ends the session as EOF does: calls in flight are cancelled, so a `submit`
    with wait cancels its run instead of leaving it unattended. An SDK client closing the
    session sends SIGTERM 2 s after stdin closed; on a loaded machine the adapter may not
    have cancelled the run by then."""
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            log.info("SIGTERM: ending the session, cancelling calls in flight")
            terminated.set()
            scope.cancel()
            return


def configure_logging() -> None:
    level = os.environ.get("TALLY_LOG", "WARNING").upper()
    logging.basicConfig(
        stream=sys.stderr, level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
