"""Slot instance states change only through one checked transition (daemon/slots/states.py)."""

from __future__ import annotations

import ast
import itertools
import logging
from pathlib import Path
from typing import Any

import pytest

from daemon.slots import instance as instance_module
from daemon.slots import member as member_module
from daemon.slots import states
from daemon.slots.records import InstanceState
from roster import Member
from tests.slots.conftest import PoolFactory
from tests.slots.fake_server import FakeServer

LEGAL = [(old, new) for old, targets in states.TRANSITIONS.items() for new in sorted(targets)]
ILLEGAL = [
    (old, new)
    for old, new in itertools.product(states.STATES, states.STATES)
    if old != new and new not in states.TRANSITIONS[old]
]


def test_the_table_covers_every_state_and_names_only_states() -> None:
    assert set(states.TRANSITIONS) == set(states.STATES)
    for targets in states.TRANSITIONS.values():
        assert targets <= set(states.STATES)
    # every state is reachable from `stopped`, and `stopped` from every state
    reach: set[InstanceState] = {"stopped"}
    while grown := {n for o in reach for n in states.TRANSITIONS[o]} - reach:
        reach |= grown
    assert reach == set(states.STATES)
    for state in states.STATES:
        assert "stopping" in states.TRANSITIONS[state] or state == "stopping"


@pytest.mark.parametrize(("old", "new"), LEGAL)
def test_a_legal_change_is_made_and_logged(
    old: InstanceState, new: InstanceState, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="tally.slots"):
        states.check("m/0", old, new)
    assert [r.getMessage() for r in caplog.records] == [f"m/0: {old} -> {new}"]


@pytest.mark.parametrize(("old", "new"), ILLEGAL)
def test_an_illegal_change_is_refused(old: InstanceState, new: InstanceState) -> None:
    assert states.STRICT  # tests/conftest.py
    with pytest.raises(states.IllegalTransition, match=f"m/0: illegal state change {old} -> {new}"):
        states.check("m/0", old, new)


def test_staying_is_no_change(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="tally.slots"):
        for state in states.STATES:
            states.check("m/0", state, state)
    assert caplog.records == []


def test_in_production_an_illegal_change_is_logged_loudly_with_its_stack(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(states, "STRICT", False)
    with caplog.at_level(logging.ERROR, logger="tally.slots"):
        states.check("m/0", "stopped", "ready")
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert "illegal state change stopped -> ready" in record.getMessage()
    assert record.stack_info


def test_no_module_sets_an_instances_state_but_enter() -> None:
    """A structural check: `state` is assigned only in `Instance.__init__` and `enter`."""
    for module in (instance_module, member_module):
        tree = ast.parse(Path(module.__file__ or "").read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                targets: list[Any] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                    targets = [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr == "state":
                        assert func.name in ("__init__", "enter"), (module.__name__, func.name)


def changes(caplog: pytest.LogCaptureFixture, who: str) -> list[str]:
    prefix = f"{who}: "
    return [
        r.getMessage()[len(prefix) :]
        for r in caplog.records
        if r.name == "tally.slots"
        and r.getMessage().startswith(prefix)
        and " -> " in r.getMessage()
    ]


async def test_an_external_instance_walks_the_table_and_refuses_a_jump(
    fake: FakeServer, make_pool: PoolFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tally.slots")
    pool = make_pool(Member(name="ext", url=fake.url, slots=2))
    await pool.start()
    async with pool.lease("ext"):
        pass
    [instance] = pool._members["ext"].instances
    assert instance.state == "ready"
    with pytest.raises(states.IllegalTransition):
        instance.enter("stopped")  # a server is stopped only after `stopping`
    assert instance.state == "ready"  # refused: unchanged
    await pool.stop()
    assert changes(caplog, "ext/0") == [
        "stopped -> starting",
        "starting -> ready",
        "ready -> stopping",
        "stopping -> stopped",
    ]
