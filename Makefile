# Everything is set up from scratch in .venv: the CPU torch wheel first (anything that pulls plain `torch`
# first gets a multi-GB CUDA build), then the package with its dev extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PROMPT ?= Ann has 12 apples. She buys 5 more. Then she gives away 3. How many apples does Ann have now?

.PHONY: install test lint demo

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff check src tests benchmarks

test: lint
	$(BIN)/python -m pytest

demo: install
	$(BIN)/refusion generate "$(PROMPT)" --show-order
