# Two commands: `make run` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: run test setup bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Installing llama-cpp-python compiles llama.cpp (see README for the time); pip caches the built wheel.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --progress-bar off -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/python -m service

test: setup
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV)
