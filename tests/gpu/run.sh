#!/usr/bin/env bash
# The GPU suite in one call (well under 10 minutes) on a node that may reach no package registry.
# Here first: bash tests/gpu/prepare_wheels.sh. There: bash tests/gpu/run.sh [OUTDIR] (default $OUT,
# else gpu-out). Stops at the first stage that fails and says which; the log is OUTDIR/gpu-suite.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:-gpu-out}}"
mkdir -p "$out"
exec > >(tee "$out/gpu-suite.log") 2>&1
stage() { echo; echo "== stage: $* ($(date -u +%H:%M:%S))"; }
trap 'echo "== FAILED in the stage above (exit $?)"' ERR

stage "environment"
nvidia-smi --query-gpu=name,uuid,pci.bus_id,driver_version,memory.total,memory.used --format=csv || true
python3 - <<'PY'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
try:
    from importlib.metadata import version
    print("cuda-bindings", version("cuda-bindings"), "| nvidia-ml-py", version("nvidia-ml-py"))
except Exception as exc:
    print("versions:", exc)
PY

stage "install (offline)"
if compgen -G ".whl/*.whl" > /dev/null; then
  site=/tmp/mmfeat-site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no .whl/: installing from a registry into .venv-gpu"
  python3 -m venv --system-site-packages .venv-gpu
  .venv-gpu/bin/python -m pip install -q -e ".[test,cuda]"
  export PATH="$PWD/.venv-gpu/bin:$PATH"
fi

stage "imports"
python3 -c "import zmq, pydantic, msgpack, numpy, mmfeat.client, mmfeat.daemon; from cuda.bindings import driver; \
from mmfeat import atomics, cuda_driver as d; print('zmq', zmq.zmq_version(), '| pydantic', pydantic.VERSION, \
'| numpy', numpy.__version__, '| libatomic (table acks):', atomics.AVAILABLE, '| driver:', d.driver_unavailable_reason() or 'ok')"

python3 -c "from mmfeat.nixl import load_nixl; load_nixl(); print('NIXL: loads')" \
  || echo "NIXL: does not load here, so test_gpu_remote.py skips"

stage "GPU tests"
set +e
timeout 480 python3 -m pytest -v -m gpu -rA -p no:cacheprovider tests/gpu --junitxml "$out/gpu-junit.xml"
rc=$?
set -e
echo "== pytest exit $rc"
exit $rc
