# The two commands of the README: `make demo` and `make test`. Both create .venv on first use
# (needs Python 3.11+ as python3): `make demo` installs only what the demo needs (sowtel with the
# tensorboard extra), `make test` adds the other extras and the test tools.
PYTHON ?= python3
VENV ?= .venv
DEMO_STAMP := $(VENV)/.demo-installed
STAMP := $(VENV)/.installed

# The newest end of the supported JAX range runs in a second environment, as JAX >= 0.11 needs
# Python >= 3.12: PYTHON_NEW is the first 3.12+ interpreter found (or set it yourself).
PYTHON_NEW ?= $(shell tests/find-python-new.sh)
VENV_NEW ?= .venv-new
STAMP_NEW := $(VENV_NEW)/.installed
# The two ends of the supported range: .venv holds the oldest, .venv-new the newest.
JAX_OLD ?= jax==0.10.2 jaxlib==0.10.2
JAX_NEW ?= jax>=0.12,<0.13 jaxlib>=0.12,<0.13
# The suites that exercise JAX itself (tracing, transforms, lowering), run on both JAX ends
# (the exporters' own suites, test_trackers included, and the subprocess-driven example
# scripts and multi-process runs, test_examples and test_multiprocess, run on the oldest end
# only).
JAX_TESTS ?= tests/test_tap.py tests/test_transform_matrix.py tests/test_sow.py \
	tests/test_session.py tests/test_summaries.py tests/test_dumps.py tests/test_postmortem.py \
	tests/test_docstrings.py tests/test_flax.py tests/test_naming.py \
	tests/test_defaults.py tests/test_jit.py tests/test_reliability.py \
	tests/test_transform_regressions.py tests/test_transform_labels.py \
	tests/test_explicit_sharding.py tests/test_startup.py tests/test_locate.py \
	tests/test_nonfinite.py tests/test_columnar.py tests/test_hardening.py \
	tests/test_watch.py tests/test_frameworks.py tests/test_many_leaves.py \
	tests/test_fuzz_transforms.py tests/test_ported_models.py tests/test_peer_ports.py \
	tests/test_bitwise.py tests/test_ecosystem.py tests/test_library_primitives.py tests/test_compare.py \
	tests/test_alerts.py tests/test_batched_cond_nested.py
# The derivative fuzzer's budget for `make fuzz` (the suite runs a fixed, smaller one: 120
# programs on the oldest end, the first 30 of them on the newest, to keep `make test` within
# its time; `make fuzz` runs the full budget on both).
FUZZ_EXAMPLES ?= 2000
FUZZ_EXAMPLES_NEW ?= 30

.PHONY: demo test test-old test-new wheel-check fuzz system-deps lint bench clean

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[tensorboard]' $(foreach r,$(JAX_OLD),'$(r)')
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[dev]' $(foreach r,$(JAX_OLD),'$(r)')
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/sowtel demo

test: system-deps test-old test-new wheel-check

test-old: $(STAMP)
	$(VENV)/bin/python -c 'import jax; print("JAX", jax.__version__)'
	$(VENV)/bin/pytest -q

$(STAMP_NEW): pyproject.toml
	@if [ -z "$(PYTHON_NEW)" ]; then \
	  echo "no Python 3.12+ found for the newest-JAX tests: set PYTHON_NEW" >&2; exit 1; fi
	$(PYTHON_NEW) -m venv $(VENV_NEW)
	$(VENV_NEW)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEW)/bin/python -m pip install -q -e '.[dev]' $(foreach r,$(JAX_NEW),'$(r)')
	touch $(STAMP_NEW)

# Without a Python 3.12+ the newest-JAX run is reported as not run (and fails under CI=true).
test-new:
	@if [ -z "$(PYTHON_NEW)" ] && [ "$${CI:-}" != true ]; then \
	  echo "make test: newest-JAX tests NOT run (no Python 3.12+; set PYTHON_NEW)" >&2; \
	else $(MAKE) --no-print-directory $(STAMP_NEW) && \
	  $(VENV_NEW)/bin/python -c 'import jax; print("JAX", jax.__version__)' && \
	  SOWTEL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES_NEW) $(VENV_NEW)/bin/pytest -q $(JAX_TESTS); fi

# What `pip install sowtel[tensorboard]` gives a user: the wheel built (with no packaging
# warning), installed not editable in a fresh environment, and checked from outside the
# repository (tests/wheel_smoke.py: LICENSE, the plugin's page, the dashboards, a short demo).
WHEEL_DIR ?= build/wheel
WHEEL_VENV ?= build/wheel-venv
wheel-check: $(DEMO_STAMP)
	rm -rf $(WHEEL_DIR) $(WHEEL_VENV)
	mkdir -p $(WHEEL_DIR)
	$(VENV)/bin/python -m pip wheel --no-deps -w $(WHEEL_DIR) . > $(WHEEL_DIR)/build.log 2>&1 \
	  || { cat $(WHEEL_DIR)/build.log; exit 1; }
	@if grep -E "would be ignored|Setuptools[A-Za-z]*Warning|BuildBackendWarning" \
	  $(WHEEL_DIR)/build.log; then \
	  echo "make wheel-check: building the wheel warned (above)" >&2; exit 1; fi
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --upgrade pip
	$(WHEEL_VENV)/bin/python -m pip install -q "$$(ls $(WHEEL_DIR)/sowtel-*.whl)[tensorboard]" \
	  $(foreach r,$(JAX_OLD),'$(r)')
	cd $(WHEEL_DIR) && ../../$(WHEEL_VENV)/bin/python ../../tests/wheel_smoke.py

# The derivative fuzzer at a larger budget, on both JAX ends (reproducible: derandomized).
fuzz: $(STAMP) $(STAMP_NEW)
	SOWTEL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VENV)/bin/pytest -q tests/test_fuzz_transforms.py
	SOWTEL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VENV_NEW)/bin/pytest -q tests/test_fuzz_transforms.py

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
	rm -rf $(VENV) $(VENV_NEW) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
