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
export PYTHONFAULTHANDLER=1  # a crash anywhere prints every thread's Python stack

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
timeout 330 python3 -m pytest -v -m gpu -rA -p no:cacheprovider --timeout 90 tests/gpu --junitxml "$out/gpu-junit.xml"
rc=$?
echo "== pytest exit $rc"

# What an operator sees first on a GPU node: the demo on the default backend (auto picks cuda_vmm),
# then a profile, the bench against a cuda_vmm daemon, and a minute of chaos on a GPU pool. None of
# them decides the exit status; each is bounded.
stage "make demo's script on the default backend"
timeout 90 python3 examples/demo.py
echo "== demo exit $?"

stage "where a feature's CPU time goes on a GPU pool"
timeout 90 python3 -m tests.gpu.profile_paths --count 300 > "$out/profile-paths.txt" 2>&1
echo "== profile exit $?"; head -4 "$out/profile-paths.txt"

stage "mmfeat bench on a GPU pool"
rt=$(mktemp -d)
python3 -m mmfeat.daemon --runtime-dir "$rt" --backend cuda_vmm --pool-mb 2048 --log-level WARNING &
dpid=$!
for _ in $(seq 150); do [ -S "$rt/mmfeatd.sock" ] && break; sleep 0.2; done
timeout 20 python3 -m mmfeat.cli --runtime-dir "$rt" --timeout 15 health
timeout 150 python3 -m mmfeat.cli --runtime-dir "$rt" bench --use-running --sizes 1M,16M --consumers 1,2 \
  --modes floor,pool_view,pool_copy,zmq_bytes,torch_mp --rounds 1 --count 200 --control-clients '' \
  --json "$out/bench-gpu.json" --targets
echo "== bench exit $?"
kill -TERM $dpid; wait $dpid; echo "== daemon exit $?"

stage "chaos on a GPU pool: workers and the daemon SIGKILLed, every byte checked"
timeout 150 python3 -m tests.chaos.chaos --backend cuda_vmm --seconds 60 --daemon-kill-every 20 > "$out/chaos-gpu.txt" 2>&1
echo "== chaos exit $?"; tail -40 "$out/chaos-gpu.txt"
exit $rc
