# Quick start: `make check` runs the gate on the bundled fixtures with the oracle as the backend;
# `make test` runs the test suite.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: check test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml constraints/hf.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,hf]' -c constraints/hf.txt
	touch $@ $(VENV)/.core

check: $(VENV)/.core
	$(BIN)/conformance check --backend refimpl --json .cache/report.json --junit-xml .cache/report.xml

test: $(VENV)/.test
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
