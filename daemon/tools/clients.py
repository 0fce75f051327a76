"""Named clients: add, list, revoke."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pydantic import Field

from daemon import record as rec
from daemon.clients import CLIENT_NAME, Limits, Scope
from daemon.errors import Conflict, NotFound
from daemon.tools.tool import Empty, Tool, ToolContext, _In, _Out

if TYPE_CHECKING:
    from daemon.service import Daemon


class ClientNameIn(_In):
    name: str = Field(pattern=CLIENT_NAME, description="The client's name.")


class ClientAddIn(ClientNameIn):
    scope: Scope = Field(description="read, submit, command or admin (each includes the former).")
    limits: Limits | None = Field(
        default=None,
        description="Rate limits and a token budget (rpm, tpm, tokens_per_day); none: unlimited.",
    )


class ClientUse(_Out):
    """What a client used, over the same windows its limits count."""

    requests_minute: int
    tokens_minute: int
    tokens_day: int


class ClientOut(_Out):
    name: str
    scope: Scope
    created_at_us: int
    limits: Limits | None = None
    used: ClientUse | None = Field(
        default=None, description="Its requests and tokens in the last minute and 24 hours."
    )


class ClientAddOut(ClientOut):
    token: str = Field(description="The bearer token: store it now, it is not kept.")


class ClientListOut(_Out):
    clients: list[ClientOut]


async def client_add(daemon: Daemon, data: ClientAddIn, ctx: ToolContext) -> ClientAddOut:
    token = await asyncio.to_thread(daemon.clients.add, data.name, data.scope, data.limits)
    body = rec.ClientAdd(name=data.name, scope=data.scope)
    if data.limits is not None and data.limits.any():  # absent otherwise: the bytes of before
        body.limits = data.limits.model_dump(exclude_none=True)
    await daemon.ledger.append(actor=ctx.client.name, kind=body.KIND, body=body.written())
    record = next(r for r in daemon.clients.records() if r.name == data.name)
    return ClientAddOut(**record.model_dump(exclude={"token_sha256"}), token=token)


CLIENT_ADD = Tool(
    "client_add",
    "Create a named client with one scope (read < submit < command < admin, each "
    "including the ones before) and return its bearer token, shown only this once.",
    ClientAddIn,
    ClientAddOut,
    client_add,
    scope="admin",
    errors=(Conflict,),
)


async def client_list(daemon: Daemon, _: Empty, ctx: ToolContext) -> ClientListOut:
    records = daemon.clients.records()
    return ClientListOut(
        clients=[
            ClientOut(
                **r.model_dump(exclude={"token_sha256"}),
                used=ClientUse(**daemon.quotas.snapshot(r.name)),
            )
            for r in records
        ]
    )


CLIENT_LIST = Tool(
    "client_list",
    "List the named clients: name, scope and when each was made (never tokens).",
    Empty,
    ClientListOut,
    client_list,
    scope="admin",
    errors=(),
)


async def client_revoke(daemon: Daemon, data: ClientNameIn, ctx: ToolContext) -> ClientOut:
    record = await asyncio.to_thread(daemon.clients.revoke, data.name)
    revoked = rec.ClientRevoke(name=data.name)
    await daemon.ledger.append(actor=ctx.client.name, kind=revoked.KIND, body=revoked.written())
    return ClientOut(**record.model_dump(exclude={"token_sha256"}))


CLIENT_REVOKE = Tool(
    "client_revoke",
    "Revoke a named client: its token stops working at once.",
    ClientNameIn,
    ClientOut,
    client_revoke,
    scope="admin",
    errors=(NotFound,),  # 403 (Forbidden) is documented on every operation
)
