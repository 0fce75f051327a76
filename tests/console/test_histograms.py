"""The latency histograms on /metrics, fed by a real run through the real daemon (the fake model
server is the pool's only stand-in), read over the real unix socket."""

from __future__ import annotations

import re

import aiohttp

from tests.console.conftest import Served
from tests.surfaces.conftest import two_tasks

SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")


def _samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) == name:
            out[m.group(2)] = float(m.group(3))
    return out


async def test_run_call_ttft_rate_and_queue_histograms(served: Served) -> None:
    engine = served.daemon.engine
    view = await engine.submit("the api", plan=two_tasks())
    assert (await engine.wait(view.id, timeout=30)).state == "done"
    connector = aiohttp.UnixConnector(path=str(served.socket))
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.get("http://tally/metrics") as resp,
    ):
        text = await resp.text()
    for family in (
        "tally_run_seconds",
        "tally_model_call_seconds",
        "tally_model_ttft_seconds",
        "tally_model_tokens_per_second",
        "tally_queue_wait_seconds",
    ):
        assert f"# TYPE {family} histogram" in text
    assert _samples(text, "tally_run_seconds_count") == {'state="done"': 1.0}
    calls = _samples(text, "tally_model_call_seconds_count")
    assert sum(calls.values()) == 3  # two tasks and the synthesis
    assert _samples(text, "tally_queue_wait_seconds_count") == {'tier="cheap"': 2.0}
    buckets = _samples(text, "tally_model_call_seconds_bucket")
    label = next(iter(calls))
    series = [v for k, v in buckets.items() if k.startswith(label)]
    assert series == sorted(series)  # cumulative
    assert series[-1] == calls[label]
    assert f'{label},le="+Inf"' in buckets
    # The fake reports usage but no llama.cpp timings: tokens/s falls back to usage / latency;
    # TTFT needs the server's prompt time (the browser test checks it on the real model).
    assert sum(_samples(text, "tally_model_tokens_per_second_count").values()) == 3
    assert not _samples(text, "tally_model_ttft_seconds_count")
