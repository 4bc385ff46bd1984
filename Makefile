# kiln: `make serve` installs everything and serves the bundled default model;
#       `make test` installs everything and runs the test suite.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kiln-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install serve test test-all lint bench clean

install: $(STAMP)

# CPU torch first: a bare `torch` requirement with no torch installed pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

serve: install
	$(VENV)/bin/kiln serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q -x

test-all: install
	$(PY) -m pytest -q -m "not gpu or gpu"

lint: install
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
