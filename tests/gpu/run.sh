#!/usr/bin/env bash
# The GPU run in one call, within 8 minutes on an H200, on a node that may reach no package registry:
# the GPU tests, the review's probes (probe_additions.py, which runs ready_probes.py's r01-r08 first, and
# gpu_probe.py, found in shared/gpu/ inside the checkout, which travels to a lent device, else
# ../shared/gpu/ beside it, or $MMFEAT_PROBES), the profile, the bench's GPU rows, a short chaos on a
# GPU pool, staged GPU reads of retained features under eviction, and the READY word's probes and test
# again under MPS where the node has its control daemon.
#   Here first: bash tests/gpu/prepare_wheels.sh (and copy ../shared/gpu into shared/gpu for the device).
#   There: bash tests/gpu/run.sh [OUTDIR] (default $OUT, else gpu-out).
#   Here, on the fake driver: MMFEAT_GPU_FAKE=1 bash tests/gpu/run.sh /tmp/gpu-fake (builds
#   tests/fake_cuda's libcuda and runs every stage against it: stages that need torch's CUDA say SKIPPED
#   with the reason, the staged chaos runs on the fake driver, and the script's plumbing, budgets and
#   cleanup are what is checked).
# Every stage is bounded by what is left of the run's budget (MMFEAT_GPU_RUN_S, default 460 s); no stage
# decides whether a later one runs. OUTDIR gets at most 8 files (what a device run brings back):
# gpu-suite.log (everything printed), verdicts.txt (one line per stage, test and probe), gpu-junit.xml,
# bench-gpu.json, probe-additions.json, gpu-probe.json, chaos-gpu.txt, and run.tgz with the rest.
# No process outlives it: each stage runs in its own process group, killed when it ends or times out.
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
out="${1:-${OUT:-gpu-out}}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/mmfeat-gpu-run.XXXXXX)
verdicts="$out/verdicts.txt"
: > "$verdicts"
exec > >(tee "$out/gpu-suite.log") 2>&1
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
start=$(date +%s)
budget=${MMFEAT_GPU_RUN_S:-460}
groups=()

stage() { echo; echo "== stage: $* ($(date -u +%H:%M:%S), $(( $(date +%s) - start )) s in)"; }
verdict() { echo "$*" | tee -a "$verdicts"; }
left() { echo $(( budget - ($(date +%s) - start) )); }
# bounded CMD...: run CMD in its own process group for at most min(SECONDS, what is left - 15 s); the
# whole group is killed after. Returns CMD's exit status (124 when it timed out).
bounded() {
  local want=$1; shift
  local t=$(( $(left) - 15 )); [ "$t" -gt "$want" ] && t=$want
  if [ "$t" -le 5 ]; then echo "== no time left for: $*"; return 125; fi
  setsid timeout -k 5 "$t" "$@" &
  local pid=$!
  groups+=("$pid")
  wait "$pid"; local rc=$?
  kill -KILL -- "-$pid" 2>/dev/null
  return $rc
}
cleanup() {
  for g in "${groups[@]}"; do kill -KILL -- "-$g" 2>/dev/null; done
  [ -n "${mps:-}" ] && echo quit | nvidia-cuda-mps-control 2>/dev/null
  [ -n "${dpid:-}" ] && kill -KILL "$dpid" 2>/dev/null
  # The rest of what the stages wrote, in one file: a device run brings back at most 8.
  tar -czf "$out/run.tgz" -C "$work" . 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

probes="${MMFEAT_PROBES:-}"
for d in shared/gpu ../shared/gpu; do
  [ -z "$probes" ] && [ -f "$d/probe_additions.py" ] && probes=$(cd "$d" && pwd)
done
if [ -n "$probes" ]; then
  # A copy of the probes, adapted where the client moved on since they were written (module paths of
  # the client's flat layout, a stand-in for a function whose signature grew: tests/gpu/wing_paths.py).
  mkdir -p "$work/probes" && cp "$probes"/*.py "$probes"/*.sh "$work/probes/" 2>/dev/null
  python3 tests/gpu/wing_paths.py "$work/probes"/*.py
  probes="$work/probes"
fi

stage "environment"
nvidia-smi --query-gpu=name,uuid,pci.bus_id,driver_version,memory.total,memory.used,compute_mode --format=csv \
  || echo "no nvidia-smi"
stage "install (offline)"
if compgen -G ".whl/*.whl" > /dev/null; then
  site=/tmp/mmfeat-site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" || verdict "install FAILED"
elif [ -x .venv/bin/python ]; then
  export PATH="$repo/.venv/bin:$PATH"; echo "no .whl/: this checkout's .venv"
else
  echo "no .whl/ and no .venv: the image's own packages"
fi

fake=${MMFEAT_GPU_FAKE:-0}
unset MMFEAT_GPU_FAKE  # the script's, not a setting: mmfeatd warns about MMFEAT_ variables it does not read
if [ "$fake" = 1 ]; then
  stage "the fake driver (tests/fake_cuda) in place of libcuda"
  python3 -c "from pathlib import Path; from tests import fake_cuda; import sys; \
r = fake_cuda.build(Path('$work/fake-libcuda')); print(r or 'built'); sys.exit(1 if r else 0)" \
    || { verdict "fake-driver FAILED: it does not build here"; exit 1; }
  export LD_LIBRARY_PATH="$work/fake-libcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" STUB_LOG="$work/fake-cuda.log"
fi

stage "imports"
python3 - <<'PY' || verdict "imports FAILED"
import sys, torch
import zmq, pydantic, msgpack, numpy, mmfeat.client, mmfeat.daemon  # noqa: F401
from mmfeat import atomics, cuda_driver as d
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
print("libatomic (table acks):", atomics.AVAILABLE, "| driver:", d.driver_unavailable_reason() or "ok")
PY
# Stages that make CUDA tensors need torch's CUDA; without it (the fake driver) they say so and skip.
no_cuda=$(python3 -c "import torch; print('' if torch.cuda.is_available() else 'torch sees no CUDA device')" 2>&1 \
  | tail -1)
timeout_args=()
if python3 -c "import pytest_timeout" 2>/dev/null; then timeout_args=(-o timeout=90); \
else echo "pytest-timeout is missing: each test is bounded by the stage's timeout alone"; fi

stage "GPU tests"
bounded 150 python3 -m pytest -v -m gpu -rA -p no:cacheprovider "${timeout_args[@]}" tests/gpu \
  --junitxml "$out/gpu-junit.xml"
rc=$?
verdict "gpu-tests exit $rc (0 all passed, 5 none ran)"
python3 - "$out/gpu-junit.xml" >> "$verdicts" <<'PY' || true
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).iter("testcase"):
    outcome = "passed"
    for child in case:
        if child.tag in ("failure", "error", "skipped"):
            outcome = f"{child.tag}: {(child.get('message') or '')[:160]}"
    print(f"test {case.get('name')}: {outcome}")
PY

if [ -n "$probes" ]; then
  stage "the READY word's probes r01-r08, then the review's additions c01-c10 ($probes/probe_additions.py)"
  bounded 170 python3 "$probes/probe_additions.py" "$work/additions" | tee "$work/additions.txt"
  verdict "probe-additions exit ${PIPESTATUS[0]}"
  grep -h "^VERDICT" "$work/additions.txt" >> "$verdicts" || true
  [ -f "$work/additions/probe-additions.json" ] && cp "$work/additions/probe-additions.json" "$out/"
else
  verdict "probes SKIPPED: no shared/gpu/probe_additions.py in the checkout (copy ../shared/gpu there)"
fi


stage "where a feature's CPU time goes on a GPU pool"
if [ -n "$no_cuda" ]; then
  verdict "profile SKIPPED: $no_cuda"
else
  bounded 40 python3 -m tests.gpu.profile_paths --count 300 > "$work/profile-paths.txt" 2>&1
  verdict "profile exit $?"; head -4 "$work/profile-paths.txt"
fi

stage "mmfeat bench on a GPU pool"
if [ -n "$no_cuda" ]; then
  verdict "bench SKIPPED: $no_cuda"
else
  rt=$(mktemp -d -p "$work")
  setsid python3 -m mmfeat.daemon --runtime-dir "$rt" --backend cuda_vmm --pool-mb 2048 --log-level WARNING &
  dpid=$!
  groups+=("$dpid")
  for _ in $(seq 100); do [ -S "$rt/mmfeatd.sock" ] && break; kill -0 "$dpid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$dpid" 2>/dev/null; then
    bounded 15 python3 -m mmfeat.cli --runtime-dir "$rt" --timeout 10 health
    bounded 70 python3 -m mmfeat.cli --runtime-dir "$rt" bench --use-running --sizes 1M,16M --consumers 1,2 \
      --modes floor,pool_view,pool_copy,zmq_bytes,torch_mp --rounds 1 --count 200 --control-clients '' \
      --json "$out/bench-gpu.json" --targets
    verdict "bench exit $?"
    kill -TERM "$dpid"; wait "$dpid"; verdict "bench daemon exit $?"
  else
    wait "$dpid"; verdict "bench SKIPPED: the cuda_vmm daemon did not start (exit $?)"
  fi
  dpid=
fi

stage "chaos on a GPU pool: workers and the daemon SIGKILLed, every byte checked"
if [ -n "$no_cuda" ]; then
  verdict "chaos SKIPPED: $no_cuda (its workers put CUDA tensors)" | tee "$out/chaos-gpu.txt"
else
  bounded 60 python3 -m tests.chaos.chaos --backend cuda_vmm --seconds 25 --daemon-kill-every 10 \
    > "$out/chaos-gpu.txt" 2>&1
  verdict "chaos exit $?"; tail -20 "$out/chaos-gpu.txt"
fi

stage "staged GPU reads of retained features while a 4 MiB host pool keeps evicting them, every byte checked"
# On the GPU where torch has CUDA, else on the fake driver (tests/chaos/staged_worker.py).
bounded 45 python3 -m tests.chaos.chaos --seconds 15 --producers 0 --consumers 0 --late 0 --keyed 3 --holders 1 \
  --staged 2 --pool-mb 4 --kill-every 1 --daemon-kill-every 10 > "$work/chaos-staged.txt" 2>&1
verdict "staged chaos exit $?"; grep -A6 '"staged": {' "$work/chaos-staged.txt"; tail -2 "$work/chaos-staged.txt"

stage "under MPS: the READY word's probes r01, r03, r04, r05, r08 and its GPU test"
# Streams that wait on READY words among MPS clients (a blocked client should hold only its own work
# queues). Opt out with MMFEAT_GPU_MPS=0. The control daemon is started here and stopped after; no
# nvidia-smi setting is changed.
if [ "${MMFEAT_GPU_MPS:-1}" = 0 ]; then
  verdict "mps SKIPPED: MMFEAT_GPU_MPS=0"
elif ! command -v nvidia-cuda-mps-control > /dev/null; then
  verdict "mps SKIPPED: no nvidia-cuda-mps-control on this node"
else
  export CUDA_MPS_PIPE_DIRECTORY="$work/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$work/mps-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    mps=1
    if [ -n "$probes" ]; then
      PROBE_BUDGET_S=60 bounded 70 python3 "$probes/probe_additions.py" "$work/mps" r01_memop_attributes \
        r03_geq_semantics_and_latency r04_two_processes r05_kill_a_waiting_process r08_a_wait_holds_other_streams \
        | tee "$work/mps.txt"
      verdict "mps probes exit ${PIPESTATUS[0]}"
      grep -h "^VERDICT" "$work/mps.txt" | sed 's/^/mps /' >> "$verdicts" || true
    fi
    bounded 40 python3 -m pytest -q -m gpu -p no:cacheprovider "${timeout_args[@]}" tests/gpu/test_gpu_ready_word.py
    verdict "mps ready-word test exit $?"
    echo quit | nvidia-cuda-mps-control; mps=
  else
    verdict "mps SKIPPED: the control daemon did not start"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

if [ -n "$probes" ] && [ -f "$probes/gpu_probe.py" ]; then
  # The earlier review's checks, last: what is left of the budget.
  stage "the review's probes c1-c9 ($probes/gpu_probe.py)"
  bounded 150 python3 "$probes/gpu_probe.py" "$work/probe"
  verdict "gpu-probe exit $?"
  [ -f "$work/probe/gpu-probe.json" ] && cp "$work/probe/gpu-probe.json" "$out/"
fi

stage "done in $(( $(date +%s) - start )) s; verdicts"
cat "$verdicts"
exit $rc
