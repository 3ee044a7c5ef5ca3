"""Where a feature's CPU time goes on a GPU pool: put, get (view and staged copy) and ack of 1 MiB and
16 MiB CUDA tensors in one process, timed and then profiled. tests/gpu/run.sh runs it so that one
device call brings back what the next optimisation needs; it asserts nothing.

    python -m tests.gpu.profile_paths [--count N]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch

from mmfeat.client import Client
from mmfeat.testing import spawn_daemon


def _loop(c: Client, src: torch.Tensor, n: int, staged: bool) -> tuple[float, float, float]:
    """(put, get, ack) mean wall µs over n rounds."""
    put = get = ack = 0.0
    for _ in range(n):
        t0 = time.perf_counter()
        d = c.put(src)
        t1 = time.perf_counter()
        v = c.get(d, device=0) if staged else c.get(d)
        t2 = time.perf_counter()
        c.ack(d)
        t3 = time.perf_counter()
        del v
        put, get, ack = put + t1 - t0, get + t2 - t1, ack + t3 - t2
    return put / n * 1e6, get / n * 1e6, ack / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=300)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    rt = Path(tempfile.mkdtemp(prefix="mmf-prof-"))
    d = spawn_daemon(rt, ["--backend", "cuda_vmm", "--pool-mb", "1024", "--log-level", "WARNING"], timeout=60)
    try:
        with Client(rt, inline_threshold=0, fallback="error") as c:
            for size in (1 << 20, 16 << 20):
                src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda:0")
                for staged in (False, True):
                    _loop(c, src, 20, staged)  # warm-up: mapping, arenas, allocator
                    cpu0 = time.process_time()
                    p, g, a = _loop(c, src, args.count, staged)
                    cpu = (time.process_time() - cpu0) / args.count * 1e6
                    print(f"{size >> 20:>3} MiB {'staged' if staged else 'view  '}: put {p:7.1f} µs  get {g:7.1f} µs  "
                          f"ack {a:6.1f} µs  process CPU {cpu:7.1f} µs per feature")
            src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda:0")
            prof = cProfile.Profile()
            prof.enable()
            _loop(c, src, args.count, False)
            prof.disable()
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(30)
            print(f"cProfile of {args.count} rounds of 1 MiB put, view get, ack:")
            print(out.getvalue())
    finally:
        d.terminate()
        d.wait(30)


if __name__ == "__main__":
    main()
