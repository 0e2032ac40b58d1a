# On a fresh machine: `make run` trains the default, `make test` runs the tests, `make test-bench`
# the benches' quick runs end to end.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-bench tools lint typecheck clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/atomtrain swarm --peers 2 --name default --overwrite --device-memory 64MB

# every test except the benches' whole runs (make test-bench): under 15 minutes on 2 cores
test: $(STAMP) tools
	$(BIN)/python -m pytest -q --durations=15 -m "not bench" tests

# each whole `atomtrain bench` run the tests make (quick ones), its output checked (CI runs both)
test-bench: $(STAMP) tools
	$(BIN)/python -m pytest -q --durations=5 -m bench tests

tools:
	@command -v tc >/dev/null || { [ "$$(id -u)" = 0 ] && (apt-get install -y -qq iproute2 >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null)) ; } || echo "iproute2 missing: the slow-network lab tests will skip"

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy src

typecheck: $(STAMP)
	$(BIN)/mypy src

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
