"""``mmfeat bench --steps``: one feature's way through the client, step by step, in one process.

The data-plane rows time whole handoffs between processes. This table splits the client's share of one
into its steps (put, to_bytes, from_bytes, get, ack), timed back to back in one process against the
bench's daemon, for the pool path and the inline path, beside a plain copy of the payload (all that
shm_ring's producer does). A ratio that misses its goal can then be traced to the step that costs it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .report import human_size

STEPS = ("put", "to_bytes", "from_bytes", "get", "ack")
_BATCHES = 10  # the median of batch means: a batch the machine's other work interrupted does not count


def run_steps(runtime_dir: Path, sizes: list[int], count: int) -> list[dict[str, Any]]:
    """Per size and path, the median over batches of each step's mean µs, with ``count`` features in all."""
    import ctypes

    import torch

    from mmfeat.client.client import Client
    from mmfeat.protos.descriptor import Descriptor

    rows = []
    clock = time.perf_counter_ns
    paths = {"pool": dict(inline_threshold=0, fallback="error"), "inline": dict(inline_threshold=1 << 62)}
    for size in sizes:
        payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
        for path, settings in paths.items():
            with Client(str(runtime_dir), **settings) as client:
                client.connect()
                batch = max(1, count // _BATCHES)
                means: list[list[float]] = []
                for b in range(_BATCHES + 1):  # the first batch warms up: arenas granted, pages touched
                    spent = [0] * len(STEPS)
                    for _ in range(batch):
                        t0 = clock()
                        desc = client.put(payload)
                        t1 = clock()
                        blob = desc.to_bytes()
                        t2 = clock()
                        got = Descriptor.from_bytes(blob)
                        t3 = clock()
                        view = client.get(got)
                        t4 = clock()
                        del view
                        client.ack(got)
                        t5 = clock()
                        for i, (a, z) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
                            spent[i] += z - a
                    if b:
                        means.append([s / batch / 1000 for s in spent])
                if not client.flush():
                    raise RuntimeError("the steps' acks did not reach the daemon")
            row: dict[str, Any] = {"size": size, "path": path}
            for i, step in enumerate(STEPS):
                row[step] = statistics.median(m[i] for m in means)
            row["total"] = sum(row[s] for s in STEPS)
            rows.append(row)
        dst = torch.empty_like(payload)
        copies = []
        for _ in range(_BATCHES):
            t0 = clock()
            for _ in range(batch):
                ctypes.memmove(dst.data_ptr(), payload.data_ptr(), size)
            copies.append((clock() - t0) / batch / 1000)
        for row in rows[-len(paths):]:
            row["copy"] = statistics.median(copies)
    return rows


def render_steps(rows: list[dict[str, Any]], count: int) -> str:
    lines = [f"client steps in one process, us per feature (median of {_BATCHES} batches, {count} features); "
             "copy: one memmove of the payload, all shm_ring's producer does",
             f"{'size':>6} {'path':<7}" + "".join(f" {s:>10}" for s in (*STEPS, "total", "copy"))]
    for r in rows:
        lines.append(f"{human_size(r['size']):>6} {r['path']:<7}"
                     + "".join(f" {r[s]:>10.2f}" for s in (*STEPS, "total", "copy")))
    return "\n".join(lines)
