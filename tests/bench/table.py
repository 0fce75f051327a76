"""The two-column table most benchmarks print: one row per measure."""

from __future__ import annotations

from collections.abc import Iterable


def print_rows(rows: Iterable[tuple[str, str]]) -> None:
    print("| measure | value |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
