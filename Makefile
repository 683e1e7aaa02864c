# Two commands for a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# The pinned CPU build is installed first so that `torch>=2.4` in the package
# is already satisfied and pip never pulls a multi-GB CUDA build here.
TORCH_PIN ?= torch==2.13.0
JOBS ?= auto

.PHONY: demo test install install-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[torch,sim,plot]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(BIN)/expertcache demo

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(JOBS) -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
