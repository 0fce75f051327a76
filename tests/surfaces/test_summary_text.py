"""`tally ledger summary` says what each count counts: a member's line is runs' model calls,
and the gateway's calls are their own lines by client and model (answered + failed), which add
up to the header's gateway count."""

from __future__ import annotations

from surfaces.cli.reading import summary_text

BODY = {
    "entries": 40,
    "model_calls": 3,
    "gateway_calls": 5,
    "gateway_errors": 1,
    "tokens": 120,
    "escalations": 0,
    "by_kind": {"model.call": 3, "gateway.reply": 6},
    "per_member": {
        "tiny": {"calls": 3, "prompt_tokens": 90, "completion_tokens": 30, "ms": 1500, "errors": 0}
    },
    "gateway": {
        "ide": {
            "lane:docs": {
                "calls": 4,
                "errors": 1,
                "prompt_tokens": 40,
                "completion_tokens": 12,
                "ms": 800,
            },
            "tiny": {"calls": 1, "errors": 0, "prompt_tokens": 5, "completion_tokens": 2, "ms": 90},
        }
    },
    "by_client": {"ide": {"runs": 0, "entries": 12}},
}


def test_summary_lines_name_what_they_count() -> None:
    lines = summary_text(BODY).splitlines()
    assert "model calls: runs 3, gateway 5 answered + 1 failed" in lines[0]
    assert "member tiny (runs): 3 calls, 90+30 tokens, 1500 ms, 20.0 tok/s, 0 errors" in lines
    assert "gateway ide → lane:docs: 4 answered + 1 failed, 40+12 tokens, 800 ms" in lines
    assert "gateway ide → tiny: 1 answered + 0 failed, 5+2 tokens, 90 ms" in lines
    answered = sum(
        int(line.split(": ")[1].split()[0]) for line in lines if line.startswith("gateway ")
    )
    assert answered == BODY["gateway_calls"]
