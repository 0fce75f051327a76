"""A limit's refusal reads as a person would say it: the count's noun agrees with it, and a
wait past two minutes is also given in hours and minutes."""

from __future__ import annotations

from daemon.quotas import Refusal


def test_refusal_messages_read_well() -> None:
    one = Refusal("ide", "rpm", allowed=1, used=1, retry_after=30.0).message()
    assert "(1 request in the last minute, 1 allowed); retry after 30.0 s" in one
    assert "(about" not in one  # under two minutes the seconds say it
    day = Refusal("batch", "tokens_per_day", allowed=50, used=61, retry_after=86000.0).message()
    assert "(61 tokens in the last 24 hours, 50 allowed)" in day
    assert day.endswith("retry after 86000.0 s (about 23 h 53 min)")
    minutes = Refusal("ide", "tpm", allowed=300, used=405, retry_after=150.0).message()
    assert minutes.endswith("(about 2 min)")
