"""The tool registry: each tool declared once, beside its handler, with its errors; one list.

The static half reads `daemon/tools/*.py` as source: a tool built anywhere but at the top of
its area's module (in a function, a loop, the registry itself) or gathered into a collection
anywhere but the registry fails here, before any surface could publish it twice or miss it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

import pytest

import daemon.tools
from daemon.errors import TallyError
from daemon.tools import ERRORS, TOOLS, _registry
from daemon.tools.tool import Empty, Tool, ToolContext

PACKAGE = Path(daemon.tools.__file__).parent
REGISTRY = PACKAGE / "__init__.py"
MODULES = sorted(p for p in PACKAGE.glob("*.py") if p != REGISTRY)


def _declarations(path: Path) -> dict[str, ast.Call]:
    """`NAME = Tool(...)` at the top of a module: its tool declarations."""
    found: dict[str, ast.Call] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "Tool"
        ):
            (target,) = node.targets
            assert isinstance(target, ast.Name)
            found[target.id] = node.value
    return found


def _tool_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Tool"
    ]


def test_every_tool_is_declared_at_the_top_of_its_module_with_its_errors() -> None:
    declared = 0
    for path in MODULES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        tops = _declarations(path)
        calls = _tool_calls(tree)
        # every Tool(...) is a module-level `NAME = Tool(...)`: none built in a function or loop
        assert len(calls) == len(tops), f"{path.name}: a Tool built outside a declaration"
        for name, call in tops.items():
            keywords = {k.arg for k in call.keywords}
            assert "errors" in keywords, f"{path.name}: {name} is declared without its errors"
        declared += len(tops)
    assert declared == len(TOOLS)
    assert not _tool_calls(ast.parse(REGISTRY.read_text(encoding="utf-8"))), (
        "the registry lists tools; it declares none"
    )


def test_only_the_registry_gathers_tools() -> None:
    names = {name for path in MODULES for name in _declarations(path)}
    gathering = (ast.List, ast.Tuple, ast.Set, ast.Dict, ast.ListComp, ast.DictComp, ast.SetComp)
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, gathering):
                inside = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                held = inside & names
                assert not held, f"{path.name} gathers tools {sorted(held)}: only the registry may"
            if isinstance(node, ast.Name):
                assert node.id not in ("TOOLS", "ERRORS"), f"{path.name} reads the registry"


def test_the_registry_holds_each_declaration_once_beside_its_handler() -> None:
    seen: list[Tool[Any, Any]] = []
    for path in MODULES:
        module = importlib.import_module(f"daemon.tools.{path.stem}")
        for name in _declarations(path):
            tool = getattr(module, name)
            assert isinstance(tool, Tool)
            # declared where its handler is
            assert tool.handler.__module__ == module.__name__, tool.name
            assert sum(t is tool for t in TOOLS.values()) == 1, f"{tool.name} not listed once"
            seen.append(tool)
    assert len(seen) == len(TOOLS) == len({t.name for t in seen})
    for tool in TOOLS.values():
        assert isinstance(tool.errors, tuple), tool.name
        assert all(isinstance(e, type) and issubclass(e, TallyError) for e in tool.errors)
        assert len(set(tool.errors)) == len(tool.errors), f"{tool.name} lists an error twice"
        assert ERRORS.get(tool.name, ()) == tool.errors


async def _nothing(daemon: Any, data: Empty, ctx: ToolContext) -> Empty:
    return data


def test_a_tool_without_errors_or_named_twice_is_refused() -> None:
    with pytest.raises(TypeError, match="errors"):
        Tool("x", "A tool.", Empty, Empty, _nothing)  # type: ignore[call-arg]
    one = Tool("x", "A tool.", Empty, Empty, _nothing, errors=())
    other = Tool("x", "Another.", Empty, Empty, _nothing, errors=())
    with pytest.raises(ValueError, match="two tools are named 'x'"):
        _registry((one, other))
