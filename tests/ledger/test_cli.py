from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from daemon.ledger import Ledger, bulk
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
        "file": str(saved),
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


def test_verify_says_what_it_checked(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build(state_dir, 3)
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "verify", *s)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "ok: 3 entries"
    assert lines[1].startswith("  chain:")
    assert lines[2].startswith("  merkle:     root ")
    assert lines[3].startswith("  checkpoint: latest, size 3 (signature valid)")
    assert lines[4] == "  bodies:     not re-hashed (add --deep)"
    code, out = run(capsys, "ledger", "verify", "--deep", *s)
    assert "  bodies:     re-hashed (--deep): 0 redacted, 0 tampered" in out.splitlines()
    code, out = run(capsys, "ledger", "verify", "--deep", "--json", *s)
    checked = json.loads(out)["checked"]
    assert checked["entries"] == 3
    assert checked["deep"] is True
    assert checked["checkpoint"]["size"] == 3
    assert checked["checkpoint"]["signature"] == "valid"


def test_verify_since_names_the_checkpoint_file(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build(state_dir, 2)
    saved = tmp_path / "pinned.ckpt"
    shutil.copy(state_dir / "ledger" / "checkpoint", saved)
    build(state_dir, 1)
    code, out = run(capsys, "ledger", "verify", "--since", str(saved), "--state", str(state_dir))
    assert code == 0
    assert out.splitlines()[0] == "ok: 3 entries"
    assert (
        f"  since:      {saved}, size 2 (valid signature): consistent with the ledger at size 3"
        in out.splitlines()
    )


@pytest.mark.parametrize(
    ("keep", "first_missing", "words"),
    [
        (slice(0, 6), 6, "entries from seq 6 on are missing"),
        ([0, 1, 2, 5, 6, 7, 8, 9], 3, "entries 3..4 are missing"),
        ([0, 1, 3, 4, 5, 6, 7, 8, 9], 2, "entry 2 is missing"),
    ],
)
def test_verify_names_the_first_missing_seq(
    state_dir: Path,
    capsys: pytest.CaptureFixture[str],
    keep: slice | list[int],
    first_missing: int,
    words: str,
) -> None:
    build(state_dir, 10)
    path = state_dir / "ledger" / "entries.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    kept = lines[keep] if isinstance(keep, slice) else [lines[i] for i in keep]
    path.write_bytes(b"".join(kept))
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "verify", "--json", *s)
    assert code == 1
    report = json.loads(out)
    assert report["first_bad_seq"] == first_missing
    assert report["size"] == first_missing
    assert words in report["reason"]
    code, out = run(capsys, "ledger", "verify", *s)
    assert code == 1
    assert out.splitlines()[0].startswith(f"FAILED at seq {first_missing}: {words}")
    assert out.splitlines()[1] == f"  checked:    entries 0..{first_missing - 1} intact before it"
    # The other commands refuse the ledger with the same seq, as one error.
    code, out = run(capsys, "ledger", "show", "--json", *s)
    assert code == 1
    error = json.loads(out)["error"]
    assert error["code"] == "ledger_corrupt"
    assert f"seq {first_missing}" in error["message"]


def test_json_errors_are_json(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build(state_dir, 2)
    s = ["--state", str(state_dir)]
    cases: list[tuple[list[str], int, str]] = [
        (["verify", "--json", "--state", str(tmp_path / "nowhere")], 2, "no_ledger"),
        (["verify", "--json", "--since", str(tmp_path / "no"), *s], 2, "usage"),
        (["get", "7", "--json", *s], 1, "not_found"),
        (["show", "--json", "--from", "-1", *s], 2, "usage"),
        (["show", "--json", "--limit", "x", *s], 2, "usage"),
        (["show", "--json", "--tail", "2", "--from", "1", *s], 2, "usage"),
        (["verify", "--json", "--bogus", *s], 2, "usage"),
        (["proof", "inclusion", "--json", *s], 2, "usage"),
    ]
    for argv, want, error_code in cases:
        code: int | str | None
        try:
            code = main(["ledger", *argv])
        except SystemExit as exit:
            code = exit.code  # argparse's own errors
        captured = capsys.readouterr()
        assert code == want, argv
        assert json.loads(captured.out)["error"]["code"] == error_code, argv
        assert set(json.loads(captured.out)["error"]) == {"code", "message"}
        assert captured.err == "", argv
    # Without --json the same errors stay one line on stderr.
    assert main(["ledger", "get", "7", *s]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("tally ledger: ")


def test_show_tail(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build(state_dir, 12)
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "show", "--tail", "3", "--json", *s)
    assert code == 0
    assert [e["seq"] for e in json.loads(out)] == [9, 10, 11]
    code, out = run(capsys, "ledger", "show", "--tail", "2", "--kind", "task", "--json", *s)
    assert [e["seq"] for e in json.loads(out)] == [8, 10]
    code, out = run(capsys, "ledger", "show", "--tail", "50", "--json", *s)
    assert len(json.loads(out)) == 12
    code, out = run(capsys, "ledger", "show", "--tail", "0", "--json", *s)
    assert json.loads(out) == []
    code, out = run(capsys, "ledger", "show", "--tail", "2", *s)
    assert [line.split()[0] for line in out.splitlines()] == ["10", "11"]
    assert main(["ledger", "show", "--tail", "2", "--limit", "3", *s]) == 2
    assert main(["ledger", "show", "--tail", "-1", *s]) == 2


def _tamper_body(state_dir: Path, value: bytes, forged: bytes) -> None:
    pack = state_dir / "ledger" / "bodies.pack"
    data = pack.read_bytes()
    assert data.count(value) == 1
    pack.write_bytes(data.replace(value, forged))


def test_get_a_tampered_body_fails(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build(state_dir, 6)
    _tamper_body(state_dir, b'{"i":4}', b'{"i":5}')
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "get", "4", *s)
    assert code == 1
    assert "body TAMPERED" in out
    assert out.splitlines()[-1] != "null"
    code, out = run(capsys, "ledger", "get", "4", "--json", *s)
    assert code == 1
    got = json.loads(out)
    assert got["body_state"] == "tampered"
    assert got["body"] is None
    code, out = run(capsys, "ledger", "get", "3", "--json", *s)
    assert code == 0
    assert json.loads(out)["body_state"] == "present"


def test_get_a_redacted_body_is_not_a_failure(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def go() -> str:
        ledger = await Ledger.open(state_dir)
        entry = await ledger.append(actor="a", kind="note", body={"secret": "x"})
        assert entry.body is not None
        await ledger.redact(entry.body, actor="a", reason="test")
        await ledger.close()
        return entry.body

    asyncio.run(go())
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "get", "0", *s)
    assert code == 0
    assert out.splitlines()[-1] == "body redacted"
    code, out = run(capsys, "ledger", "get", "0", "--json", *s)
    assert code == 0
    assert json.loads(out)["body_state"] == "redacted"


@pytest.mark.parametrize("bad_seq", [1, 2500])
def test_verify_of_a_big_ledger_names_only_the_entries_before_the_bad_one(
    state_dir: Path, capsys: pytest.CaptureFixture[str], bad_seq: int
) -> None:
    # > TAIL_CHECK entries: the ledger opens and `Ledger.verify` finds the flipped byte.
    bulk.build(state_dir, 3000)
    path = state_dir / "ledger" / "entries.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[bad_seq] = lines[bad_seq].replace(b'"actor":"bench"', b'"actor":"bench"'.upper(), 1)
    path.write_bytes(b"\n".join(lines))
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "verify", *s)
    assert code == 1
    first, second = out.splitlines()[:2]
    assert first == f"FAILED at seq {bad_seq}: entry bytes do not match the recorded leaf hash"
    intact = "entry 0" if bad_seq == 1 else f"entries 0..{bad_seq - 1}"
    assert second == f"  checked:    {intact} intact before it"
    code, out = run(capsys, "ledger", "verify", "--json", *s)
    assert code == 1
    report = json.loads(out)
    assert report["first_bad_seq"] == bad_seq
    assert report["size"] == bad_seq
    assert report["checked"]["entries"] == bad_seq


def test_verify_since_accepts_the_checkpoint_json(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build(state_dir, 4)
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "checkpoint", "--json", *s)
    assert code == 0
    saved = tmp_path / "pinned.json"
    saved.write_text(out)
    build(state_dir, 3)
    code, out = run(capsys, "ledger", "verify", "--since", str(saved), "--json", *s)
    assert code == 0, out
    since = json.loads(out)["since"]
    assert (since["size"], since["signature"], since["consistent"]) == (4, "valid", True)
    # The note text itself still works, and the output says the same.
    note = tmp_path / "pinned.note"
    note.write_text(json.loads(saved.read_text())["note"])
    code, out = run(capsys, "ledger", "verify", "--since", str(note), "--json", *s)
    assert code == 0
    assert {**json.loads(out)["since"], "file": None} == {**since, "file": None}
    # JSON that is not a checkpoint is a usage error naming the file.
    for text in ('{"size": 4}', "{not json", '["note"]'):
        saved.write_text(text)
        code, out = run(capsys, "ledger", "verify", "--since", str(saved), "--json", *s)
        assert code == 2
        error = json.loads(out)["error"]
        assert error["code"] == "usage"
        assert str(saved) in error["message"]


def test_deep_verify_lists_each_tampered_body_with_why(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build(state_dir, 4)

    async def remove_unwitnessed() -> tuple[str, str]:
        ledger = await Ledger.open(state_dir, checkpoint_interval=None)
        changed, removed = (await ledger.get(1)).body or "", (await ledger.get(2)).body or ""
        ledger.bodies.redact(bytes.fromhex(removed))  # no `redaction` entry witnesses this
        await ledger.close()
        return changed, removed

    changed, removed = asyncio.run(remove_unwitnessed())
    pack = state_dir / "ledger" / "bodies.pack"
    pack.write_bytes(pack.read_bytes().replace(b'{"i":1}', b'{"i":9}'))
    s = ["--state", str(state_dir)]
    code, out = run(capsys, "ledger", "verify", "--deep", *s)
    assert code == 1
    lines = out.splitlines()
    at = lines.index("TAMPERED bodies (2):")
    assert lines[at + 1 : at + 3] == [
        f"  {changed}: changed",
        f"  {removed}: missing (no redaction witnessed)",
    ]
    code, out = run(capsys, "ledger", "verify", "--deep", "--json", *s)
    assert json.loads(out)["tampered_why"] == {
        changed: "changed",
        removed: "missing (no redaction witnessed)",
    }


def _tree_of_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("how", ["deleted", "older"])
def test_verify_reports_a_deleted_or_older_checkpoint_and_changes_nothing(
    state_dir: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    # A checkpoint vouches for the record; deleting it (or putting an older one back) once
    # left `ledger verify` saying ok: the file was simply "none yet".
    build(state_dir, 5)
    checkpoint = state_dir / "ledger" / "checkpoint"
    older = checkpoint.read_bytes()
    build(state_dir, 3)  # a second session: its close signs size 8
    s = ["--state", str(state_dir)]
    assert run(capsys, "ledger", "verify", *s)[0] == 0
    if how == "deleted":
        checkpoint.unlink()
    else:
        checkpoint.write_bytes(older)
    before = _tree_of_files(state_dir)
    for deep in ([], ["--deep"]):
        code, out = run(capsys, "ledger", "verify", "--json", *deep, *s)
        report = json.loads(out)
        assert code == 1
        assert not report["ok"]
        said = json.dumps(report)
        assert "meta.json records a signed checkpoint at size 8" in said
        assert ("is missing" if how == "deleted" else "older one (size 5)") in said
    code, out = run(capsys, "ledger", "verify", *s)
    assert code == 1
    assert "checkpoint" in out
    assert _tree_of_files(state_dir) == before  # read-only: nothing changed


def test_a_since_file_nested_past_jsons_limit_is_the_files_fault_not_the_ledgers(
    state_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # It once made verify say "FAILED at seq N … (verify stopped: RecursionError …)": a bad
    # argument reported as a broken record.
    build(state_dir, 3)
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' + "[" * 30_000 + "]" * 30_000 + "}")
    code = main(["ledger", "verify", "--state", str(state_dir), "--since", str(deep)])
    said = capsys.readouterr()
    assert code == 2
    assert f"cannot read checkpoint {deep}: not JSON" in said.err
    assert "FAILED" not in said.out + said.err


def test_a_meta_file_nested_past_jsons_limit_reads_as_none(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # meta.json is derived (checked, not trusted): a damaged one once stopped every open
    # with a RecursionError.
    build(state_dir, 3)
    (state_dir / "ledger" / "meta.json").write_text('{"a": ' + "[" * 30_000 + "]" * 30_000 + "}")
    assert main(["ledger", "verify", "--state", str(state_dir)]) == 0, capsys.readouterr()
    build(state_dir, 1)  # the owner opens, and writes a good one back
    assert main(["ledger", "verify", "--state", str(state_dir)]) == 0
