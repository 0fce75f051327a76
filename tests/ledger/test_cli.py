from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from daemon.ledger import Ledger
from daemon.ledger.merkle import verify_consistency, verify_inclusion
from surfaces.cli import main


def build(state_dir: Path, n: int) -> None:
    async def go() -> None:
        ledger = await Ledger.open(state_dir)
        for i in range(n):
            await ledger.append(actor="cli", kind="note" if i % 2 else "task", body={"i": i})
        await ledger.close()

    asyncio.run(go())


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_verify_show_get_and_proofs(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build(state_dir, 12)
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "verify", "--deep", "--json", *s)
    report = json.loads(out)
    assert code == 0
    assert report["ok"]
    assert report["size"] == 12
    code, out = run(capsys, "ledger", "show", "--kind", "note", "--limit", "2", "--json", *s)
    assert [e["seq"] for e in json.loads(out)] == [1, 3]
    code, out = run(capsys, "ledger", "get", "4", "--json", *s)
    got = json.loads(out)
    assert got["body"] == {"i": 4}
    assert got["body_state"] == "present"
    code, out = run(capsys, "ledger", "proof", "inclusion", "4", "--size", "9", "--json", *s)
    proof = json.loads(out)
    assert set(proof) == {"leaf_index", "tree_size", "root", "path"}
    leaf = bytes.fromhex(got["entry"]["hash"])
    path = [bytes.fromhex(p) for p in proof["path"]]
    assert verify_inclusion(4, 9, leaf, path, bytes.fromhex(proof["root"]))
    code, out = run(capsys, "ledger", "proof", "consistency", "5", "--json", *s)
    cons = json.loads(out)
    assert set(cons) == {"old_size", "new_size", "old_root", "new_root", "path"}
    assert verify_consistency(
        5,
        12,
        bytes.fromhex(cons["old_root"]),
        bytes.fromhex(cons["new_root"]),
        [bytes.fromhex(p) for p in cons["path"]],
    )
    code, out = run(capsys, "ledger", "checkpoint", "--json", *s)
    assert code == 0
    assert json.loads(out)["verified"]
    code, out = run(capsys, "ledger", "checkpoint", *s)
    assert out.splitlines()[1] == "12"


def test_verify_since_a_saved_checkpoint(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build(state_dir, 5)
    saved = tmp_path / "pinned"
    shutil.copy(state_dir / "ledger" / "checkpoint", saved)
    build(state_dir, 7)
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "verify", "--since", str(saved), "--json", *s)
    assert code == 0
    assert json.loads(out)["since"] == {
        "size": 5,
        "root": json.loads(out)["since"]["root"],
        "signature": "valid",
        "consistent": True,
    }
    forged = saved.read_text().replace(saved.read_text().split("\n")[2], "A" * 43 + "=")
    saved.write_text(forged)
    code, _ = run(capsys, "ledger", "verify", "--since", str(saved), *s)
    assert code == 1


def test_verify_fails_with_the_seq_and_usage_errors(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build(state_dir, 9)
    path = state_dir / "ledger" / "entries.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"kind":"task"', b'"kind":"tusk"')
    path.write_bytes(b"\n".join(lines))
    code, out = run(capsys, "ledger", "verify", "--json", "--state", str(state_dir))
    assert code == 1
    assert json.loads(out)["first_bad_seq"] == 2
    code, out = run(capsys, "ledger", "verify", "--state", str(state_dir))
    assert "seq 2" in out
    assert main(["ledger", "verify", "--state", str(tmp_path / "nowhere")]) == 2
    assert (
        main(["ledger", "verify", "--since", str(tmp_path / "no"), "--state", str(state_dir)]) == 2
    )
    with pytest.raises(SystemExit) as err:
        main(["ledger", "show", "--limit", "x"])
    assert err.value.code == 2


def test_state_dir_from_environment(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    build(state_dir, 2)
    monkeypatch.delenv("TALLY_STATE_DIR", raising=False)
    monkeypatch.setenv("STATE_DIRECTORY", str(state_dir))
    code, out = run(capsys, "ledger", "get", "1")
    assert code == 0
    assert '"seq":1' in out
    monkeypatch.setenv("TALLY_STATE_DIR", str(state_dir.parent / "other"))
    assert main(["ledger", "get", "1"]) == 2
