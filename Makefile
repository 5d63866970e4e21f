# Quick start: `make check` runs the gate on the bundled fixtures with the oracle as the backend;
# `make test` runs the test suite.
# Both create .venv and install what they need on first use.
#
# Real engines: `make check-backends` runs the gate for transformers (float32, float64), mlx-lm,
# mlx-vlm (image and audio prompts too) and the subprocess protocol's reference server and writes
# .cache/reports/scoreboard.md;
# `make llama-cpp` builds llama-cpp-python from source (about 7 minutes, cached under .cache/), after
# which `make check-backends CHECK_ARGS=--llama-cpp` adds llama.cpp. CHECK_ARGS=--all adds every
# dtype and attention (docs/backends.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

CHECK_ARGS ?=

.PHONY: check test test-slow lint check-backends llama-cpp browser clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml constraints/engines.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,hf,mlx,cluster,plot,chat,server]' -c constraints/engines.txt
	touch $@ $(VENV)/.core

$(VENV)/.llama-cpp: scripts/build-llama-cpp.sh | $(VENV)/.test
	PYTHON=$(CURDIR)/$(BIN)/python scripts/build-llama-cpp.sh --exact-gelu
	touch $@

check: $(VENV)/.core
	mkdir -p .cache
	$(BIN)/conformance check --backend refimpl --json .cache/report.json --junit-xml .cache/report.xml

# the suite on the machine's cores (pytest-xdist, at most 4 workers; a test file stays on one worker, so
# module-scoped fixtures are built once): TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= auto

test: $(VENV)/.test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile

# the opt-in tests (the full mutation self-test on every bundled case; docs/testing.md)
test-slow: $(VENV)/.test
	$(BIN)/python -m pytest -m slow

# ruff (pycodestyle, pyflakes, import order, bugbear, blind excepts; pyproject.toml): run by .ci/run first
lint: $(VENV)/.test
	$(BIN)/ruff check .

check-backends: $(VENV)/.test
	PATH="$(CURDIR)/$(BIN):$$PATH" scripts/check-backends.sh $(CHECK_ARGS)

llama-cpp: $(VENV)/.llama-cpp

# headless Chromium (Debian's package), for the HTML report's browser tests; they skip without it, and fail
# without it under GEMMA4_CONFORMANCE_REQUIRE_ENGINES=1 (CI)
browser:
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
