"""How `make test` shares the suite between its two pytest-xdist workers (`-n 2 --dist
loadgroup`; tests/conftest.py installs this scheduler for that mode).

A work unit goes to one worker and its tests run there in order:
- every test module marked `integration` (it starts a real model server, chromium or an MCP
  client) is one unit, "real-servers": the suite never holds two real model servers at once;
- the shared record's modules (tests/ledger_pg) are one unit: the session's one PostgreSQL;
- any other module is its own unit, so a module-scoped fixture starts once.

xdist's own loadgroup reads `xdist_group` marks from node ids it rewrites, which pytest 9 no
longer lets a plugin do; the units here are decided from the node ids alone.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

REAL_SERVERS = "real-servers"
POSTGRESQL = "postgresql"
_INTEGRATION = re.compile(r"pytest\.mark\.integration\b")


class SharedWorkers(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        if _marked_integration(self.config.rootpath / module):
            return REAL_SERVERS
        if module.startswith("tests/ledger_pg/"):
            return POSTGRESQL
        return module


@functools.cache
def _marked_integration(path: Path) -> bool:
    try:
        return bool(_INTEGRATION.search(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError):
        return False
