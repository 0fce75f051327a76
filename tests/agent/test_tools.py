"""The tools and the call reader on their own: exact errors, caps, repairs within limits."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon.runs.agent import Jail, ToolLimits, native_supported
from daemon.runs.agent.calls import Malformed, call_schema, from_native, from_text, rescue
from daemon.runs.agent.conversation import Conversation, Message
from daemon.runs.agent.toolbox import Toolbox


def box(root: Path, **limits: Any) -> Toolbox:
    return Toolbox(Jail.of(root), None, ToolLimits(**limits))


async def use(tb: Toolbox, name: str, **arguments: Any) -> tuple[bool, str]:
    seen = await tb.use(name, arguments, thread=asyncio.to_thread)
    return seen.ok, seen.text


async def test_edit_fails_loudly_unless_the_match_is_exact_and_unique(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\nx = 1\ny = 2\n")
    tb = box(tmp_path)
    assert await use(tb, "edit", path="a.py", old="x = 1", new="x = 3") == (
        False,
        "edit failed: the old text matches 2 places in a.py; include more surrounding lines "
        "so that it matches exactly once",
    )
    ok, said = await use(tb, "edit", path="a.py", old="z = 9", new="")
    assert not ok
    assert "was not found in a.py" in said
    ok, said = await use(tb, "edit", path="a.py", old="x = 1\ny = 2", new="y = 3")
    assert ok
    assert said.startswith("edited a.py at line 2")
    assert (tmp_path / "a.py").read_text() == "x = 1\ny = 3\n"


async def test_an_edit_of_the_same_size_within_the_second_is_seen_by_python(
    tmp_path: Path,
) -> None:
    """Python trusts a .pyc whose source has the same whole-second mtime and size."""
    (tmp_path / "m.py").write_text("V = 1\n")
    check = [sys.executable, "-c", "import m; print(m.V)"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}

    def value() -> str:
        return subprocess.run(check, cwd=tmp_path, env=env, capture_output=True, text=True).stdout

    assert value() == "1\n"
    assert (tmp_path / "__pycache__").is_dir()
    assert (await use(box(tmp_path), "edit", path="m.py", old="1", new="2"))[0]
    assert value() == "2\n"


async def test_read_file_ranges_caps_and_binary(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("".join(f"line {i}\n" for i in range(1, 101)))
    (tmp_path / "b.bin").write_bytes(b"\x7fELF\x00\x01")
    tb = box(tmp_path, read_chars=50)
    ok, said = await use(tb, "read_file", path="t.txt", start_line=3, end_line=4)
    assert (ok, said) == (True, "t.txt: lines 3-4 of 100\nline 3\nline 4\n")
    ok, said = await use(tb, "read_file", path="t.txt")
    assert ok
    assert said.endswith("read again with start_line=8]")
    assert await use(tb, "read_file", path="t.txt", start_line=500) == (
        False,
        "'t.txt' has 100 lines; start_line is past its end",
    )
    assert await use(tb, "read_file", path="b.bin") == (
        False,
        "'b.bin' is a binary file: only text files can be read",
    )
    ok, said = await use(tb, "read_file", path="missing.txt")
    assert not ok
    assert "does not exist" in said


async def test_list_search_and_write_are_capped(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"f{i:02}.py").write_text(f"value = {i}\n")
    tb = box(tmp_path, list_entries=10, search_matches=5, write_chars=100)
    ok, said = await use(tb, "list_files", glob="*.py")
    assert said.count("\n") == 10
    assert said.endswith("give a subdirectory or a glob to see more]")
    ok, said = await use(tb, "search", pattern=r"value = \d+")
    assert said.count("\n") == 5
    assert "f00.py:1: value = 0" in said
    assert (await use(tb, "search", pattern="(unclosed"))[1].startswith("not a valid RE2 pattern")
    ok, said = await use(tb, "write_file", path="big.txt", content="x" * 101)
    assert not ok
    assert "at most 100 are written" in said
    ok, said = await use(tb, "write_file", path="new/dir/a.txt", content="hi")
    assert (ok, (tmp_path / "new/dir/a.txt").read_text()) == (True, "hi")


async def test_run_without_a_runner_is_refused(tmp_path: Path) -> None:
    assert await use(box(tmp_path), "run", argv=["ls"]) == (
        False,
        "run is not available for this task",
    )


def test_a_symlinked_view_root_is_its_real_path(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    jail = Jail.of(tmp_path / "link")
    assert jail.resolve("a/b.txt") == ("a/b.txt", tmp_path / "real" / "a" / "b.txt")


@pytest.mark.parametrize(
    ("reply", "how"),
    [
        ('{"tool": "list_files", "arguments": {}}', "parsed"),
        ('```json\n{"tool": "list_files", "arguments": {}}\n```', "fenced"),
        ('I will list: {"tool": "list_files", "arguments": {}} ok?', "object"),
        ('{"tool": "list_files", "arguments": {"path": ".",},}', "repaired"),
        ("{'tool': 'list_files', 'arguments': {'glob': '*.py'}}", "repaired"),
        ('{"tool": "list_files", "arguments": {"path": "."', "repaired"),
        ('{"tool": "list_files", "arguments": {"glob": "*.p', "repaired"),
        ('{"name": "list_files", "arguments": "{\\"path\\": \\".\\"}"}', "parsed"),
    ],
)
def test_rescue_finds_and_repairs_a_call(reply: str, how: str) -> None:
    call = from_text(reply)
    assert (call.tool, call.parse) == ("list_files", how)


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ("I cannot do that.", "holds no JSON object"),
        ('{"tool": "list_files", "arguments": {"path": [[[[[', "does not parse"),
        ('{"tool": "rm", "arguments": {}}', "there is no tool 'rm'"),
        ('{"tool": "read_file", "arguments": {}}', "path: Field required"),
        ('{"tool": "read_file", "arguments": {"path": "a", "mode": "w"}}', "mode: Extra inputs"),
        ('{"arguments": {}}', "names no tool"),
        ("x" * 70_000, "reply with one short tool call"),
    ],
)
def test_rescue_stops_at_its_limits_with_the_exact_error(reply: str, error: str) -> None:
    with pytest.raises(Malformed, match=error):
        from_text(reply)


@pytest.mark.parametrize("reply", ["{" * 60_000, "[" * 60_000, '{"a": ' + "[" * 60_000])
def test_rescue_survives_a_hostile_reply(reply: str) -> None:
    with pytest.raises(Malformed):
        rescue(reply)


def test_arguments_given_as_a_deeply_nested_string_are_malformed_not_a_crash() -> None:
    # The reply itself parses; its "arguments" string nests past json's recursion limit: the
    # RecursionError once escaped the loop's `except Malformed` and ended the attempt.
    deep = "[" * 30_000 + "]" * 30_000
    reply = json.dumps({"tool": "read_file", "arguments": deep})
    with pytest.raises(Malformed, match="not a JSON object"):
        from_text(reply)


async def test_run_refuses_an_argv_the_kernel_cannot_take(tmp_path: Path) -> None:
    async def never(argv: list[str]) -> Any:
        raise AssertionError("not run")

    tb = Toolbox(Jail.of(tmp_path), never, ToolLimits())
    for argv in (["ls\x00"], [""], ["x" * 9000]):
        ok, said = await use(tb, "run", argv=argv)
        assert not ok
        assert said.startswith(("an argument holds a NUL byte", "the argv is over"))


def test_native_calls_take_the_first_and_count_the_rest() -> None:
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "x"}'},
        },
        {"id": "b", "type": "function", "function": {"name": "finish", "arguments": "{}"}},
    ]
    call = from_native(calls, "")
    assert (call.tool, call.arguments, call.id, call.extra) == ("read_file", {"path": "x"}, "a", 1)
    with pytest.raises(Malformed, match="no tool call and no text"):
        from_native([], " ")


def test_native_support_is_read_from_props() -> None:
    assert native_supported({"chat_template_caps": {"supports_tool_calls": True}})
    assert not native_supported({"chat_template_caps": {"supports_tool_calls": False}})
    assert native_supported({"chat_template": "{% if tools %}<tool_call>{% endif %}"})
    assert not native_supported({"chat_template": "{{ messages }}"})
    assert not native_supported({})


def test_the_call_schema_has_no_size_bounds_for_the_grammar() -> None:
    text = str(call_schema())
    assert "maxLength" not in text
    assert "maxItems" not in text
    assert "title" not in text


def test_compaction_drops_whole_steps_once_stubs_do_not_fit() -> None:
    c = Conversation(n_ctx=600, reserve=100, keep_last=1)
    c.add(Message({"role": "system", "content": "s"}, 0, "system"))
    c.add(Message({"role": "user", "content": "task"}, 0, "task"))
    for step in range(1, 40):
        c.add(
            Message(
                {"role": "assistant", "content": '{"tool": "list_files"}'},
                step,
                "call",
                "list_files",
            )
        )
        c.add(Message({"role": "user", "content": "o" * 300}, step, "observation", "list_files"))
        c.fit()
        assert c.tokens() <= c.budget
    wire = c.wire()
    assert wire[:2] == [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    assert wire[2]["content"].startswith("[cut to save context: steps 1-")
    assert "list_files x" in wire[2]["content"]
    assert wire[-1]["content"] == "o" * 300


async def test_optional_arguments_sent_empty_are_absent(tmp_path: Path) -> None:
    """What small models send for "not this one": null or "" optional arguments are absent,
    and an empty glob lists every file; required arguments are still required."""
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# b\n")
    tb = box(tmp_path)
    every = "a.py (6 bytes)\ndocs/b.md (4 bytes)"
    for glob in ("", "  ", None, "*", "**"):
        assert await use(tb, "list_files", path=None, glob=glob) == (True, every)
    assert await use(tb, "list_files", path="", glob="*.rs") == (
        True,
        "no files matching '*.rs' under '.': list_files with no glob shows every file",
    )
    ok, said = await use(tb, "read_file", path="a.py", start_line=None, end_line="")
    assert (ok, said) == (True, "a.py: lines 1-1 of 1\nx = 1\n")
    ok, said = await use(tb, "search", pattern="x", glob="", path=None)
    assert (ok, said) == (True, "a.py:1: x = 1")
    with pytest.raises(ValueError, match="content"):
        await use(tb, "write_file", path="c.txt", content=None)
    # a missing file or directory: the observation says what to send instead
    ok, said = await use(tb, "read_file", path="new.txt")
    assert not ok
    assert "call write_file with path 'new.txt'" in said
    ok, said = await use(tb, "list_files", path="new.txt")
    assert not ok
    assert "to create a file, call write_file" in said
    assert tb.overview(2) == ["a.py (6 bytes)", "docs/b.md (4 bytes)"]
    assert tb.overview(1) is None  # a larger view is not listed up front


def test_compacting_a_deeply_nested_old_reply_cuts_it_instead_of_crashing() -> None:
    from daemon.runs.agent.conversation import _shorten_arguments, _shorten_text_call

    deep = "[" * 30_000 + "]" * 30_000
    assert json.loads(_shorten_arguments(deep)) == {"cut": "60000 characters of arguments"}
    assert _shorten_text_call(deep).startswith("[cut: 60,000 characters")
