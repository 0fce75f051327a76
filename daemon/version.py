"""The installed tallyd version, without loading the rest of the daemon.

`tally version` and the MCP adapter's `initialize` answer need only this; importing
`daemon.tools` for it would build every tool model first.
"""

from __future__ import annotations

import functools


@functools.cache
def package_version() -> str:
    """The installed tallyd version, as health, MCP and `tally version` all report it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tallyd")
    except PackageNotFoundError:  # pragma: no cover - only in a source checkout without install
        return "0+unknown"
