"""`python -m tests.surfaces.fake_serve SOCKET`: `surfaces.http.serve` over the fake daemon.

Lets the sd_notify test exercise the real serving path (READY after start + listen, WATCHDOG
from the loop, STOPPING on SIGTERM) without models or the real engine.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from surfaces.http import HttpOptions, Listen, serve
from tests.surfaces.fake import FakeDaemon


def main() -> None:
    daemon = FakeDaemon()
    asyncio.run(serve(daemon, Listen(Path(sys.argv[1])), HttpOptions()))  # type: ignore[arg-type]
    assert daemon.stopped


if __name__ == "__main__":
    main()
