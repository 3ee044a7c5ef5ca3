"""The CUDA driver API on a machine without a GPU: fake_libcuda.c, built here with the C compiler, is
loaded by cuda-bindings as libcuda.so.1 from LD_LIBRARY_PATH in a child process. It answers the calls
the GPU path makes, can fail on demand, and logs each call with the context current at the time, so a
test reads what the daemon's and the client's CUDA code asked of the driver, call by call.

torch's CPU build has no CUDA runtime: scenarios.py stands in for the little of torch.cuda the client
calls (availability, the current device, and the runtime's own reference to a primary context).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).parent
SOURCE = HERE / "fake_libcuda.c"
SCENARIOS = HERE / "scenarios.py"
ROOT = HERE.parent.parent


def build(libdir: Path) -> Optional[str]:
    """Build libcuda.so.1 into ``libdir``; None when it is there and loads, else why not."""
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "cuda-python is not installed (pip install 'mmfeat[cuda]')"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler to build the fake libcuda"
    libdir.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(libdir / "libcuda.so.1"), str(SOURCE), "-ldl",
                        "-lpthread"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return f"the fake libcuda does not build: {r.stderr.strip()[:500]}"
    probe = "from mmfeat import cuda_driver as d; r = d.driver_unavailable_reason(); print(r or 'ok')"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LD_LIBRARY_PATH": str(libdir), "STUB_LOG": os.devnull})
    if r.stdout.strip() != "ok":
        return f"cuda-bindings does not load the fake libcuda: {(r.stdout + r.stderr).strip()[-500:]}"
    return None


def run(libdir: Path, log: Path, scenario: str, env: Optional[dict[str, str]] = None, timeout: float = 600) -> str:
    """Run one scenario of scenarios.py against the fake driver; the driver's log (with the scenario's
    own ``=== `` marks). A scenario that fails fails the test with its output. ``timeout`` only bounds one
    that hangs: a busy machine takes a minute to start an interpreter that imports torch."""
    full = {**os.environ, "LD_LIBRARY_PATH": str(libdir), "STUB_LOG": str(log), **(env or {})}
    r = subprocess.run([sys.executable, str(SCENARIOS), scenario], capture_output=True, text=True, timeout=timeout,
                       env=full, cwd=ROOT)
    text = log.read_text() if log.exists() else ""
    assert r.returncode == 0, f"scenario {scenario} exited {r.returncode}:\n{r.stdout}\n{r.stderr}\nlog:\n{text}"
    return text


def section(log: str, start: str, end: Optional[str] = None) -> str:
    """The part of a log from the mark ``=== start`` up to the mark ``=== end`` (or the end)."""
    after = log.split(f"=== {start}\n", 1)[1]
    return after.split(f"=== {end}\n", 1)[0] if end else after
