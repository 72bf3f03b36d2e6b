# The two commands of the README: `make demo` and `make test`.
VENV ?= .venv
EXTRA ?= cpu
BIN = $(VENV)/bin

.PHONY: install demo test test-unit up down bench-clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml deploy/install.sh
	bash deploy/install.sh $(VENV) $(EXTRA)
	touch $@

# Embedded broker + Redis Cluster, bundled model, one worker, a burst of mixed requests.
demo: install
	$(BIN)/sluice demo

# Unit tests (no services) and integration tests (real broker, Redis Cluster, vLLM + SmolLM2).
test: install
	$(BIN)/sluice dev up
	$(BIN)/sluice model prepare
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 tests

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

up: install
	$(BIN)/sluice dev up

down:
	$(BIN)/sluice dev down
