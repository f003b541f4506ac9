# Two commands on a fresh machine, each doing its own set-up:
#   make demo   -- a GPT-style model trains a few steps under backend="zinf" and prints losses + memory
#   make test   -- the test suite (what .ci/run calls)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.zinf-setup

# torch is pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 resolves to the CPU build here.
$(VENV)/.zinf-setup: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 triton==3.9.0 numpy pytest matplotlib
	$(BIN)/pip install -q --no-deps -e .
	touch $@

demo: setup
	$(BIN)/python examples/train_gpt.py

test: setup
	$(BIN)/python -m pytest -p no:cacheprovider -rs

clean:
	rm -rf $(VENV) *.egg-info
