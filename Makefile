# Quick start: `make check` runs the oracle on the bundled default; `make test` runs the test suite.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO   := .cache/demo

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
	$(BIN)/refimpl synth --preset all-features --seed 0 --out $(DEMO) --force
	$(BIN)/refimpl inspect --model $(DEMO)
	$(BIN)/refimpl logits --model $(DEMO) --prompt "Why is the sky blue?" --chat --rows all --out $(DEMO)-logits.safetensors
	$(BIN)/refimpl generate --model $(DEMO) --prompt "the model" --max-new-tokens 16

test: $(VENV)/.test
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
