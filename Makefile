# The two commands a newcomer needs: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup serve test lint bench clean

$(BIN)/treespark: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[serve,loadtest,dev]'
	@touch $@

setup: $(BIN)/treespark

serve: setup
	RAY_AUTH_MODE=disabled $(BIN)/serve run configs/cluster.yaml

test: setup
	RAY_AUTH_MODE=disabled $(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check treespark deployments loadtests tests deploy

clean:
	rm -rf $(VENV) .pytest_cache
