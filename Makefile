# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint wheel clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[serve,client,test]"
	$(PY) -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/splitserve serve --model tiny --layout both

test: $(STAMP)
	$(VENV)/bin/ruff check backends client kernels tools scripts tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check backends client kernels tools scripts tests
	$(VENV)/bin/ruff format --check backends client kernels tools scripts tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The wheel (templates and C++ kernel sources as package data) into dist/, with no downloads.
wheel: $(STAMP)
	rm -rf build
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) build dist
