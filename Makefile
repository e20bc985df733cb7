# The two commands a newcomer needs: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup fetch-model serve test lint bench clean

$(BIN)/treespark: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[serve,loadtest,dev]'
	@touch $@

setup: $(BIN)/treespark

# The default target in the model cache (~/.cache/treespark): downloaded and converted
# once (the network is needed only then), a no-op when the cache is complete.
fetch-model: setup
	$(BIN)/treespark fetch-model

serve: setup
	RAY_AUTH_MODE=disabled $(BIN)/serve run configs/cluster.yaml

test: setup fetch-model
	RAY_AUTH_MODE=disabled $(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check treespark deployments loadtests tests deploy

clean:
	rm -rf $(VENV) .pytest_cache
