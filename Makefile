# Two commands on a fresh machine: `make run` and `make test`. Each installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ENGINE_PY := .venv-engine/bin/python
GATEWAY_STAMP := $(VENV)/.installed
LINT_PATHS := gateway engine_patch engine bench tests migrations

.PHONY: run lint test test-fast bench soak install engine clients services check-pools clean

$(GATEWAY_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

install: $(GATEWAY_STAMP)

# The SGLang engine stack (torch CPU, sglang 0.5.23, Mooncake, sglang-router) in its own venv.
engine:
	scripts/install-engine

# The real clients the end-to-end tests drive (guidellm, lm-eval), into the engine's venv,
# whose CPU torch they need (scripts/install-clients says why).
clients: engine
	scripts/install-clients

services:
	scripts/services

run: install engine
	$(PY) scripts/run-dev

# Static checks, first in every test run: under a minute, and they fail before any cluster starts.
# ruff's rules and formatting ([tool.ruff] in pyproject.toml), then strict mypy over gateway and
# engine_patch ([tool.mypy]); all from .venv, so no engine install is needed.
lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

# The gateway's suite (unit, stand-in and real-SGLang end-to-end tests) on TEST_WORKERS xdist
# workers (one module at a time each; tests/conftest.py), and beside it engine_patch's unit tests
# and the parser/template parity tests against the real SGLang classes (engine venv; they start
# no server), whose output follows the gateway suite's. Fails if either fails. The groups are
# handed out in the order tests/conftest.py gives them (longest first), not xdist's own.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
ENGINE_SUITE_LOG := .run/engine-suite.log
# The engine's install (mostly waiting on downloads and the disk) runs beside the gateway's
# install and the static checks; each one's output is printed whole when it ends.
test:
	@$(MAKE) --no-print-directory --jobs=3 --output-sync=target lint clients services
	@mkdir -p .run
	@$(ENGINE_PY) -m pytest -ra --durations=10 tests/engine_patch tests/engine_parity tests/engine_bounds \
		> $(ENGINE_SUITE_LOG) 2>&1 & engine=$$!; \
	$(PY) -m pytest -ra --durations=25 $(PARALLEL); gateway=$$?; \
	wait $$engine; engine_status=$$?; \
	echo "== engine venv suite (tests/engine_patch tests/engine_parity tests/engine_bounds) =="; \
	cat $(ENGINE_SUITE_LOG); \
	test $$gateway -eq 0 && test $$engine_status -eq 0

# Without the real SGLang cluster (unit tests and stand-in workers only).
test-fast: lint install services
	$(PY) -m pytest -ra -m "not engine" $(PARALLEL)

bench: install engine services
	scripts/bench

# The incident replay at its real numbers (real SGLang, DeepSeek-V4 tokenizer; tens of minutes);
# SOAK=fuzz runs the real-engine fuzzing long, with a fresh seed (scripts/soak lists the others).
SOAK ?= incident-real
soak: install engine services
	scripts/soak $(SOAK)

check-pools: install
	$(VENV)/bin/isogate check-pools

clean:
	rm -rf .run .pytest_cache .mypy_cache .ruff_cache
