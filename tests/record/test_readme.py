"""The README documents the record's kinds from their models: its table is what
`python -m tests.record.readme` makes from `daemon.record` (run it after adding a kind)."""

from __future__ import annotations

from daemon import record
from tests.record.readme import README, rendered, table


def test_the_readme_table_of_kinds_is_made_from_the_models() -> None:
    text = README.read_text()
    assert rendered(text) == text, "run `python -m tests.record.readme` and commit README.md"
    for model in record.KINDS:
        assert f"| `{model.KIND}` |" in table()
