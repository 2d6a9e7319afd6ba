# `make run`: set up .venv (CPU torch first, so no multi-GB CUDA build is pulled) and run the
# quickstart pipeline. `make test`: same set-up, then the test suite. The set-up installs the
# test, docs and search extras (search: the adaptive sweeps' packages, which the tests run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test test-long test-fast lint docs setup clean

run: $(STAMP)
	$(BIN)/raydp-train run pipelines/quickstart.yaml

# Two pytest-xdist workers, each with its own local Ray: one process left a quarter of 2 cores
# idle while Ray starts, stops and waits. Each worker takes whole files (a module's Ray head
# or cluster starts once), in collection order: those that start processes first
# (tests/conftest.py). Every test over 10 s is listed at the end: where the time goes.
# The package is installed editable, so pip compiles none of it: compiled here, each of the
# suite's hundreds of processes (Ray's workers included) reads it instead of compiling it
# again where PYTHONDONTWRITEBYTECODE is set (0.1 CPU s a process; benchmarks/RESULTS.md).
# The end-to-end checks of a minute or more on 2 cores (marked `long`; the shorter test that
# keeps each guarantee in `make test` is named beside the mark) run in `make test-long`,
# which CI runs after `make test`: `make test` keeps its 20 minutes.
TEST_WORKERS ?= 2
PYTEST_XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=0 \
	--durations-min=10
test: $(STAMP)
	$(BIN)/python -m compileall -q raydp_train
	$(BIN)/python -m pytest $(PYTEST_XDIST) -m "not long"

test-long: $(STAMP)
	$(BIN)/python -m compileall -q raydp_train
	$(BIN)/python -m pytest $(PYTEST_XDIST) -m long

# The edit loop: math, schema, ledger, engine; no Ray, no other process (tests/conftest.py) and
# none of the in-process checks of seconds (training runs, randomized or PLD checks; marked
# thorough), which `make test` runs. It keeps under 2 minutes on 2 cores.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not ray and not slow and not cluster and not thorough"

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link, a missing
# page or an API name the code no longer has fails the build. A few seconds.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The linter CI runs (pyproject.toml [tool.ruff]); the version is pinned in the test extra.
lint: $(STAMP)
	$(BIN)/ruff check raydp_train tests benchmarks pipelines docs

setup: $(STAMP)

# torch through pip (pip alone finds the CPU build on this machine's disk); the rest through
# uv, which installs the same packages in 24 s instead of pip's 55 (benchmarks/RESULTS.md),
# compiling them as pip does: this machine sets PYTHONDONTWRITEBYTECODE, so a package left
# uncompiled is compiled again by every process that imports it. pip if uv cannot be had.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	($(BIN)/python -m pip install --quiet uv && \
	  $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode -e ".[test,docs,search]") || \
	  $(BIN)/python -m pip install --quiet -e ".[test,docs,search]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs site .pytest_cache
