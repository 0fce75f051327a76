"""The product's import graph: no cycles, and data flows one way.

Read from the source with `ast` (nothing is imported): every `import` and `from … import`
counts, at module level, inside functions and under `TYPE_CHECKING` alike, because an import a
function makes lazily is still a dependency, and one kept inside a function only to dodge a
cycle is the cycle this test exists to catch. Relative imports are resolved, and `from pkg
import name` is an edge to `pkg.name` when that is a module, else to `pkg` itself.

The direction the founders set: surfaces -> daemon.tools (the registry) -> engine ->
pool/ledger. Nothing under `daemon/` or `roster/` reads `surfaces/`; the ledger and the slot
pool read neither the runs engine nor the tool registry; the gateway (beside the engine) and
the record's vocabulary (below every writer) read neither either.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "surfaces", "roster")


@functools.cache
def modules() -> dict[str, Path]:
    """Every product module by dotted name (a package by its own name, not `.__init__`)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from … import` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imports(
    tree: ast.AST, name: str, is_package: bool, known: set[str]
) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import statement anywhere in the tree."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else base), node.lineno


@functools.cache
def graph() -> dict[str, dict[str, int]]:
    """Module -> {product module it imports: the first line that does}."""
    known = modules()
    edges: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        out: dict[str, int] = {}
        for target, line in _imports(tree, name, path.name == "__init__.py", set(known)):
            if target in known and target != name:
                out.setdefault(target, line)
        edges[name] = out
    return edges


def groups(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of modules (Tarjan): each module of a group imports,
    through the others, every other one, itself included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        # Recursive Tarjan: the product's import depth is far below the recursion limit.
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle through each group."""
    return [_shortest_cycle(edges, group) for group in groups(edges)]


def _shortest_cycle(edges: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    """The shortest path from the group's first module back to itself, inside the group."""
    start = group[0]
    members = set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in edges[v]:
                if w == start:
                    return [*paths[v], start]
                if w in members and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {group}")  # Tarjan said there is one


def _show(edges: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} (line {edges[a][b]}) -> {b}" for a, b in itertools.pairwise(cycle)]
    return "\n    ".join(steps)


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    edges = graph()
    shown = []
    for group in groups(edges):
        cycle = _shortest_cycle(edges, group)
        shown.append(_show(edges, cycle))
        if len(group) >= len(cycle):  # more modules are tied in than this one cycle shows
            shown.append(f"  ({len(group)} modules tied together: {', '.join(group)})")
    assert not shown, "import cycles:\n  " + "\n  ".join(shown)


# (importer prefix, imported prefix, why it must not)
FORBIDDEN = [
    ("daemon", "surfaces", "the engine and the registry serve the surfaces, not the reverse"),
    ("roster", "surfaces", "the roster is read by the surfaces, not the reverse"),
    ("daemon.ledger", "daemon.runs", "the ledger is below the engine"),
    ("daemon.ledger", "daemon.tools", "the ledger is below the tool registry"),
    ("daemon.slots", "daemon.runs", "the slot pool is below the engine"),
    ("daemon.slots", "daemon.tools", "the slot pool is below the tool registry"),
    ("daemon.gateway", "daemon.runs", "the gateway sits beside the engine, not above it"),
    ("daemon.gateway", "daemon.tools", "the gateway sits below the tool registry"),
    ("daemon.record", "daemon.runs", "the record's vocabulary is below everything that writes it"),
    ("daemon.record", "daemon.tools", "the record's vocabulary is below the tool registry"),
    ("daemon.record", "daemon.service", "the record's vocabulary is below the daemon"),
]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_data_flows_one_way() -> None:
    edges = graph()
    wrong = [
        f"{src} (line {line}) imports {dst}: {why}"
        for src, targets in sorted(edges.items())
        for dst, line in sorted(targets.items())
        for low, high, why in FORBIDDEN
        if _under(src, low) and _under(dst, high)
    ]
    assert not wrong, "imports against the flow:\n  " + "\n  ".join(wrong)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The reader itself: a cycle made only of a function-level import, a relative import and
    a `TYPE_CHECKING` import is found (a reader that missed one would pass everything)."""
    edges = {
        "p.a": {"p.b": 3},  # `from p import b` inside a function
        "p.b": {"p.c": 1},  # `from .c import x`
        "p.c": {"p.a": 9},  # under TYPE_CHECKING
        "p.d": {"p.a": 1},
    }
    assert cycles(edges) == [["p.a", "p.b", "p.c", "p.a"]]
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from .deep import thing\n"
        "if TYPE_CHECKING:\n    from daemon.x import Y\n"
        "def f():\n    import surfaces.z\n"
    )
    tree = ast.parse(source)
    got = {t for t, _ in _imports(tree, "pkg.mod", is_package=False, known={"pkg.sibling"})}
    assert got == {"typing", "pkg.sibling", "pkg.deep", "daemon.x", "surfaces.z"}


LONG = 600
ONE_PIECE = re.compile(r"\bone (piece|module|file)\b", re.IGNORECASE)


def test_a_long_file_says_at_its_top_why_it_is_one_piece() -> None:
    """Past 600 lines, a product module's docstring says why it is one piece ("One module
    past 600 lines: …")."""
    silent = []
    for path in modules().values():
        where = str(path.relative_to(ROOT))
        text = path.read_text()
        if text.count("\n") <= LONG:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not ONE_PIECE.search(doc):
            silent.append(f"{where} ({text.count(chr(10))} lines)")
    assert not silent, "long files that do not say why they are one piece: " + ", ".join(silent)
