"""`tally doctor` on agent-cli members: each one's program found, executable and shown by
the sandbox, and its version probe answering there within the timeout; through the real CLI,
with real bubblewrap and the scripted CLI of tests/runs/fakecli.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest

from daemon.runs.agentcli import probe
from daemon.runs.sandbox import Confinement
from roster.models import CommandPolicy, Member
from surfaces.cli import main
from tests.runs import fakecli

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def cli_member(name: str, argv: list[str], binds: list[str], **extra: object) -> str:
    fields = {"name": name, "kind": "agent-cli", "argv": argv, "ro_binds": binds, **extra}
    return "[[models]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())


async def test_doctor_probes_each_agent_cli_in_the_sandbox_and_names_each_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = fakecli.write(tmp_path / "cli")
    elsewhere = fakecli.write(tmp_path / "elsewhere")
    plain = tmp_path / "cli" / "plain"
    plain.write_text("not a program\n")
    binds = [str(fake.parent)]
    members = [
        cli_member("ok", [str(fake), "fix"], binds),
        cli_member("missing", ["no-such-agent-cli-on-path"], binds),
        cli_member("notexec", [str(plain)], binds),
        cli_member("unbound", [str(elsewhere), "fix"], binds),
        cli_member("hangs", [str(fake), "fix"], binds, version_argv=[str(fake), "hang"]),
        cli_member("fails", [str(fake), "fix"], binds, version_argv=[str(fake), "fail"]),
    ]
    names = ["ok", "missing", "notexec", "unbound", "hangs", "fails"]
    roster = tmp_path / "roster.toml"
    roster.write_text(
        "version = 1\n"
        + "\n".join(members)
        + f'\n[tiers]\nladder = ["agents"]\nagents = {json.dumps(names)}\n'
        + '[[lanes]]\nname = "x"\nkeywords = ["x"]\ntier = "agents"\nsystem = "s"\n'
    )
    started = time.monotonic()
    code = await asyncio.to_thread(main, ["doctor", "--roster", str(roster), "--timeout", "2"])
    assert time.monotonic() - started < 30  # the probes run at once, each bounded
    assert code == 1
    out = capsys.readouterr().out
    problem = {
        line.strip().removeprefix("problem: ").split(":", 1)[0]: line
        for line in out.splitlines()
        if line.strip().startswith("problem: ")
    }
    assert set(problem) == {"missing", "notexec", "unbound", "hangs", "fails"}
    assert "not on the daemon's PATH" in problem["missing"]
    assert "not an executable file" in problem["notexec"]
    assert "outside what the sandbox shows" in problem["unbound"]
    assert "add its install dir to the member's ro_binds" in problem["unbound"]
    assert "did not answer within 2 s" in problem["hangs"]
    assert "exited 3" in problem["fails"]
    assert "boom" in problem["fails"]
    row = next(line for line in out.splitlines() if line.startswith("ok "))
    assert "agent-cli" in row
    assert "ok" in row.split()
    assert fakecli.leftovers("987.654") == []  # the hanging probe's tree is gone

    code = await asyncio.to_thread(
        main, ["doctor", "--roster", str(roster), "--timeout", "2", "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    found = {m["name"]: m for m in report["members"]}
    assert found["ok"]["ok"]
    assert found["ok"]["server"] == "fakecli 1.2.3"
    assert found["ok"]["kind"] == "agent-cli"
    assert [m["name"] for m in report["members"]] == names


async def test_a_bind_that_would_show_the_state_dir_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    fake = fakecli.write(tmp_path / "cli")
    state = tmp_path / "state"
    state.mkdir()
    for bind in (str(tmp_path), str(state / "inner")):
        (state / "inner").mkdir(exist_ok=True)
        member = Member.model_validate(
            {"name": "c", "kind": "agent-cli", "argv": [str(fake)], "ro_binds": [bind]}
        )
        report = await probe(member, CommandPolicy(), Confinement(hidden=(state,)), 5)
        assert not report.ok
        assert "which no task may see" in report.findings[0].problem


def test_tally_run_says_an_agent_cli_call_in_words() -> None:
    from surfaces.cli.stream import attempt_lines

    # The rest of a real agent.cli body (what AgentCli publishes): the lines read it as one.
    call = {
        "task": "fix",
        "attempt": 1,
        "member": "aider",
        "argv": ["aider"],
        "prompt": "stdin",
        "prompt_sha256": "0" * 64,
        "env": [],
        "network": False,
        "exit_code": 0,
        "timed_out": False,
        "limit": None,
        "stdout_sha256": "0" * 64,
        "stdout_chars": 0,
        "stdout_head": "",
        "stderr_sha256": "0" * 64,
        "stderr_tail": "",
        "truncated": False,
        "diff_sha256": None,
    }
    lines = attempt_lines(
        [
            {
                "seq": 4,
                "kind": "agent.cli",
                "content": {**call, "duration_ms": 812, "files": ["calc.py"]},
            },
            {
                "seq": 9,
                "kind": "agent.cli",
                "content": {
                    **call,
                    "exit_code": 3,
                    "files": [],
                    "duration_ms": 40,
                    "stderr_tail": "boom",
                },
            },
            {
                "seq": 12,
                "kind": "agent.cli",
                "content": {
                    **call,
                    "exit_code": None,
                    "timed_out": True,
                    "files": [],
                    "duration_ms": 2001,
                    "stderr_tail": "",
                },
            },
        ]
    )["fix"]
    assert lines == [
        "  agent CLI aider: exit 0 in 812 ms, changed calc.py  [seq 4]",
        "  agent CLI aider: exit 3 in 40 ms: boom  [seq 9]",
        "  agent CLI aider: timed out in 2001 ms  [seq 12]",
    ]


async def test_a_config_dir_inside_home_is_granted_but_home_and_its_parents_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    config = home / ".config" / "fakecli"
    config.mkdir(parents=True)
    (config / "settings").write_text("colour = blue\n")
    monkeypatch.setenv("HOME", str(home))  # the daemon's home, hidden from every task
    fake = fakecli.write(tmp_path / "cli")
    confinement = Confinement(hidden=(home, tmp_path / "state"))

    def member(bind: str, argv: list[str]) -> Member:
        return Member.model_validate(
            {"name": "c", "kind": "agent-cli", "argv": argv, "ro_binds": [str(fake.parent), bind]}
        )

    looked = member("~/.config/fakecli", ["cat", f"{config}/settings"])
    report = await probe(
        looked.model_copy(update={"version_argv": ["cat", f"{config}/settings"]}),
        CommandPolicy(),
        confinement,
        10,
    )
    assert report.ok, report.findings
    assert report.server == "colour = blue"  # the CLI reads its own config
    for bind in (str(home), str(tmp_path)):
        report = await probe(member(bind, [str(fake)]), CommandPolicy(), confinement, 10)
        assert not report.ok
        assert "which no task may see" in report.findings[0].problem


async def test_the_daemon_warns_at_start_of_an_agent_cli_it_could_not_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from daemon.service import Daemon
    from tests.runs.model_server import ScriptedServer, settings_for
    from tests.runs.test_agentcli import roster_text

    server = ScriptedServer([], default="x")
    await server.start()
    fake = fakecli.write(tmp_path / "cli")
    text = roster_text(server.url, fake, ["fix"], "agents")
    text = text.replace(json.dumps(str(fake)), json.dumps(str(tmp_path / "gone" / "agent")))
    caplog.set_level(logging.INFO, logger="daemon.service")
    daemon = Daemon(settings_for(tmp_path, text))
    await daemon.start()
    try:
        deadline = time.monotonic() + 10
        while "member check: cli" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.05)
        warned = [r.getMessage() for r in caplog.records if "member check: cli" in r.getMessage()]
        assert "is not an executable file" in warned[0]
    finally:
        await daemon.stop()
        await server.stop()
