# Each target sets up what it needs on a fresh machine: a .venv with the package and its test tools.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The CPU build of torch; any torch >= 2.1 works, this one installs quickly where it is cached.
TORCH ?= torch==2.13.0

.PHONY: setup test demo run clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[test,cuda]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/python examples/demo.py

run: $(STAMP)
	$(BIN)/mmfeatd

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
