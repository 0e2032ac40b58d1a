# Two commands on a fresh machine: `make run` trains the default, `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/atomtrain swarm --peers 2 --name default --overwrite --device-memory 64MB

test: $(STAMP)
	@command -v tc >/dev/null || { [ "$$(id -u)" = 0 ] && (apt-get install -y -qq iproute2 >/dev/null || (apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null)) ; } || echo "iproute2 missing: the slow-network lab tests will skip"
	$(BIN)/python -m pytest -q --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy src

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
