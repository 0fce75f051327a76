"""`make bench`: run every benchmark module in tests/bench and print its table.

Each benchmark module exposes `main() -> None` that prints one table. Benchmarks measure
ratios against a reference run in the same process (the machine is shared and noisy).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import tests.bench as bench_pkg


def main() -> None:
    only = set(sys.argv[1:])
    for info in sorted(pkgutil.iter_modules(bench_pkg.__path__), key=lambda i: i.name):
        if not info.name.startswith("bench_") or (only and info.name not in only):
            continue
        module = importlib.import_module(f"tests.bench.{info.name}")
        print(f"\n## {info.name}\n", flush=True)
        module.main()


main()
