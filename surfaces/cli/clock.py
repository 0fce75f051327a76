"""Times as a person reads them: the record's microsecond timestamps in local time, durations
in the largest units that matter. Machine output (`--json`) keeps the raw integers."""

from __future__ import annotations

import datetime as dt


def local_time(us: int | None) -> str:
    """`2026-11-27 00:43:48` in the local time zone ("-" for none)."""
    if us is None:
        return "-"
    try:
        return dt.datetime.fromtimestamp(us / 1e6).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):  # a hostile or broken record's number
        return f"{us} µs"


def duration(seconds: float) -> str:
    """`850 ms`, `12.3 s`, `4 min 05 s`, `3 h 02 min`, `2 d 4 h`."""
    if seconds < 0:
        seconds = 0.0
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def ago(us: int | None, now_us: int | None = None) -> str:
    """`local time (12.3 s ago)`."""
    if us is None:
        return "-"
    import time

    now = time.time_ns() // 1000 if now_us is None else now_us
    return f"{local_time(us)} ({duration((now - us) / 1e6)} ago)"
