"""How a command's process treats its memory, below the command modules (each may call it).

Start-up allocates tens of thousands of objects that live as long as the process (modules,
classes, pydantic validators): at the default thresholds the cyclic GC scans them again and
again, about a tenth of a daemon's start. So `main` raises the threshold while a command
starts; a command that goes on running (the daemon, the MCP adapter) calls `long_start()` first
and `settled()` once it is up, and a short command ends first. At exit the interpreter's last
collections would walk every object once more: frozen first, they skip them (another tenth of a
short command).
"""

from __future__ import annotations

import contextlib
import gc

GC_DEFAULT = gc.get_threshold()
GC_STARTING = (10_000, 50, 100)  # a young-generation pass per 10k objects instead of per 700
# A daemon's start keeps ~100k new objects and makes ~2k of cyclic garbage: even a pass per 10k
# scanned the survivors ten times (~20 ms, a sixteenth of its start). Up to settled() it makes
# none; a start that allocates far more (a bug in a replay) still gets its passes.
GC_LONG_START = (1_000_000, 50, 100)


M_ARENA_MAX = -8  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
MMAP_FROM = 64 * 1024


def long_start() -> None:
    """A command that goes on running is starting: no collection until `settled()` (or until
    `main` returns), whose freeze then keeps the start's few cyclic leftovers for good."""
    gc.set_threshold(*GC_LONG_START)


def settled() -> None:
    """Start-up is over: keep its objects out of every later collection, normal GC again, at
    most two malloc arenas, and blocks of MMAP_FROM bytes or more mapped on their own.

    glibc gives a thread that allocates under contention an arena of its own (up to 8 per
    core), and memory freed there stays there: worker threads that read 64 KiB bodies made the
    soak's RSS grow twice as fast as the memory Python holds. Big transient buffers (command
    outputs, bodies read for SSE backlogs and summaries) left holes in the heap that later
    small objects pinned: a burst of readers added ~25 MiB of RSS for good (soak RSS
    5,000/500 runs 1.45 -> 1.2). Mapped on their own, they go back to the system when freed.
    A no-op off glibc.
    """
    gc.freeze()
    gc.set_threshold(*GC_DEFAULT)
    import ctypes  # here: 2 ms of import that only long-running commands need

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, 2)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_FROM)
