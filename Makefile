# The two commands of the README: `make demo` and `make test`. Both create .venv and install
# sowtel with its extras on first use (needs Python 3.11+ as python3).
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: demo test system-deps lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sowtel demo

test: system-deps $(STAMP)
	$(VENV)/bin/pytest -q

# Prometheus and Chromium for the end-to-end tests: installed with apt when possible, else a
# message with the command to run, within seconds.
system-deps:
	@tests/system-deps.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check sowtel exporters tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
