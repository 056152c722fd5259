# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Spark needs Java 17; Debian's openjdk-17 is the supported JDK.
export JAVA_HOME ?= $(firstword $(wildcard /usr/lib/jvm/java-17-openjdk-amd64 /usr/lib/jvm/java-17-openjdk-arm64 /usr/lib/jvm/java-17-openjdk))
PYTEST_ARGS ?=
# pytest-xdist workers (tests/conftest.py: a database per worker, the tests marked `alone` and the Spark
# tests one at a time on one worker, a file's tests together). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

.PHONY: demo test test-quick chaos bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench,metrics,spark,dashboard]'
	@sh scripts/ensure-jdbc.sh || true
	@sh scripts/ensure-pg15.sh || true
	@sh scripts/ensure-chromium.sh || true
	@sh scripts/ensure-pgbouncer.sh || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/bus demo

# The whole suite, chaos and Spark included (what CI runs), after the lint gate.
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_ARGS)

# The quick subset: everything but the slow multi-process, chaos and Spark tests.
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m 'not slow' $(XDIST) $(PYTEST_ARGS)

# The long chaos run of every usage pattern (the bounded one, 25 s of faults and on until every fault kind has fired, is part of `make test`);
# counts per pattern are printed. CHAOS_SEED=N replays a run's fault schedule; CHAOS_KEEP=1 keeps its
# recordings; CHAOS_PATTERNS=tx,txlow / CHAOS_KINDS=kill,rebalance narrow a run.
CHAOS_SECONDS ?= 180
chaos: $(STAMP)
	CHAOS_SECONDS=$(CHAOS_SECONDS) $(BIN)/python -m pytest -q -s tests/chaos $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/bus bench

lint: $(STAMP)
	$(BIN)/ruff check bus actors storage tests benchmarks
	$(BIN)/ruff format --check bus actors storage tests benchmarks
	$(BIN)/mypy --strict bus actors storage

clean:
	rm -rf $(VENV) .bus
