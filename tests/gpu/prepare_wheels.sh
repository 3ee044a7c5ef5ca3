#!/usr/bin/env bash
# Run here, before tests/gpu/run.sh goes to a GPU node that reaches no package registry: puts into .whl/
# (git-ignored) the cp312 x86-64 wheels of what that node's image lacks (pyzmq, pydantic and its
# three companions, and NIXL for the cross-node test, at the versions this checkout's .venv tested) and
# mmfeat's own wheel. NIXL's wheel is repacked without the part mmfeat never imports, to fit the
# device run's 64 MiB carry (tests/gpu/slim_wheel.py). NIXL's build must match the node's CUDA major:
# the lent image is CUDA 13 (torch cu130), where nixl-cu12 cannot register GPU memory. NIXL_CUDA=12
# picks the CUDA 12 build.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
cu=${NIXL_CUDA:-13}
mkdir -p .whl
rm -f .whl/*.whl
pins=$($py - <<'PY'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("pyzmq", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")))
print(version("nixl-cu12"))  # the version tested here; the node gets that version's build for its CUDA
PY
)
nixl_version=$(echo "$pins" | tail -1)
# With its CUDA runtime, as the mesh extras install it: the daemon loads it for NIXL (mmfeat.nixl).
if [ "$cu" = 12 ]; then cudart="nvidia-cuda-runtime-cu12>=12.0,<13"; else cudart="nvidia-cuda-runtime>=13.0,<14"; fi
pins="$(echo "$pins" | head -1) nixl-cu$cu==$nixl_version $cudart"
echo "== wheels for the GPU node: $pins"
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pins
$py tests/gpu/slim_wheel.py .whl/nixl_cu$cu-*.whl nixl_ep_cu$cu
rm -rf build/lib  # setuptools copies sources there and never removes a deleted module
$py -m pip wheel -q --no-deps --no-build-isolation -w .whl .
ls -l .whl
du -sh .whl  # the device run carries at most 64 MiB, the working tree included
