# Each target sets up what it needs on a fresh machine: a .venv with the package and its test tools.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The CPU build of torch; any torch >= 2.1 works, this one installs quickly where it is cached.
TORCH ?= torch==2.13.0

.PHONY: setup test demo run chaos clean

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

# Minutes, not part of make test: random SIGKILLs under load with every byte checked, then a fuzzer
# of the control socket and the fd channel. docs/reliability.md records a run.
CHAOS_SECONDS ?= 120
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos.chaos --seconds $(CHAOS_SECONDS)
	$(BIN)/python -m tests.chaos.fuzz --frames 50000 --handshakes 5000

run: $(STAMP)
	$(BIN)/mmfeatd

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
