#!/usr/bin/env bash
# The GPU suite in one call (under 5 minutes): set up, then run tests/gpu with a hard limit.
# Uses the machine's own CUDA build of torch (a venv with system site packages), so nothing is
# downloaded on a GPU node that cannot reach a registry.
# Usage: bash tests/gpu/run.sh [LOGFILE]
set -uo pipefail
cd "$(dirname "$0")/../.."
log="${1:-gpu-suite.log}"
venv=.venv-gpu
{
  echo "== $(date -u) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  test -x $venv/bin/python || python3 -m venv --system-site-packages $venv
  $venv/bin/python -m pip install -q --no-build-isolation -e ".[test,cuda]" 2>&1 | tail -3
  $venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  timeout 280 $venv/bin/python -m pytest -v -m gpu -rA -p no:cacheprovider tests/gpu
  echo "== pytest exit $?"
} 2>&1 | tee "$log"
