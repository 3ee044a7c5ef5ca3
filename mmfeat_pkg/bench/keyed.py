"""``mmfeat bench --keys``: what keyed requests cost the daemon, a request at a time.

A scheduler (another process) asks about a handful of retained features under keys, as a server's
frontend does before it schedules a request that may reuse them: ``lookups`` checks and looks them up
(has_many and lookup, two requests an iteration, while nobody writes the lease table), ``holds`` holds
one and acks that hold in the table (one request an iteration, each finding the previous hold's ack).
The row reports mmfeatd's CPU per request, every thread of it, from /proc, and how many sweeps of the
lease table the row made (``sweeps``) and found nothing to read (``skipped``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

from .report import human_size

MIXES = ("lookups", "holds")
_KEYS = 8
_WARMUP = 50


def _scheduler(runtime_dir: str, keys: list[str], count: int, pipe: Any) -> None:
    """Run each mix the bench sends, ``count`` iterations after a warm-up, and report its seconds."""
    from mmfeat.client import Client

    with Client(runtime_dir, map_pools=False) as c:
        while (mix := pipe.recv()) is not None:
            for timed in (False, True):
                t0 = time.perf_counter()
                for i in range(count if timed else _WARMUP):
                    key = keys[i % len(keys)]
                    if mix == "lookups":
                        c.has_many(keys)
                        c.lookup(key)
                    else:
                        c.ack(c.hold(key))  # the ack is a compare-and-swap in the table: no request
                if not timed:
                    if not c.flush():
                        raise RuntimeError("the warm-up's acks did not reach the daemon")
                    pipe.send("warm")
                    pipe.recv()
            pipe.send(time.perf_counter() - t0)
            c.flush()


def run_keyed(runtime_dir: Path, size: int, count: int, rounds: int, daemon_pid: int,
              cpu_seconds: Callable[[int], Optional[float]]) -> list[dict[str, Any]]:
    """Rows of {mix, round, requests, seconds, daemon_cpu_us (per request), sweeps, skipped}."""
    import torch

    from mmfeat.client import Client, Namespace
    from mmfeat.testing import worker_context

    ns = Namespace(framework="mmfeat-bench", version="1", model="keys", dtype="uint8")
    keys = [ns.key(f"feature{i}") for i in range(_KEYS)]
    ctx = worker_context()
    parent, child = ctx.Pipe()
    rows = []
    with Client(str(runtime_dir), fallback="error") as producer:
        for k in keys:
            producer.put(torch.zeros(size, dtype=torch.uint8), key=k, retain_ttl=3600.0)
        proc = ctx.Process(target=_scheduler, args=(str(runtime_dir), keys, count, child))
        proc.start()
        try:
            for rnd in range(rounds):
                for mix in MIXES:
                    parent.send(mix)
                    if not parent.poll(600) or parent.recv() != "warm":
                        raise SystemExit(f"mmfeat bench: the {mix} warm-up did not finish in 600 s")
                    before, cpu0 = producer.stats()["counters"], cpu_seconds(daemon_pid)
                    parent.send("go")
                    if not parent.poll(600):
                        raise SystemExit(f"mmfeat bench: the {mix} row did not finish in 600 s")
                    seconds = parent.recv()
                    cpu1, after = cpu_seconds(daemon_pid), producer.stats()["counters"]
                    requests = count * (2 if mix == "lookups" else 1)
                    rows.append({
                        "mix": mix, "round": rnd, "size": size, "requests": requests, "seconds": seconds,
                        "daemon_cpu_us": (cpu1 - cpu0) / requests * 1e6 if cpu0 is not None and cpu1 is not None
                        else None,
                        "sweeps": after["sweeps"] - before["sweeps"],
                        "skipped": after["sweeps_skipped"] - before["sweeps_skipped"],
                    })
            parent.send(None)
            proc.join(30)
        finally:
            if proc.is_alive():
                proc.kill()
        for k in keys:
            producer.evict(k)
    return rows


def render_keyed(rows: list[dict[str, Any]]) -> str:
    lines = [f"keyed requests from a scheduler process, {_KEYS} retained features of {human_size(rows[0]['size'])}; "
             "mmfeatd CPU per request (every thread); sweeps of the lease table over the row, and those that found "
             "nothing changed",
             f"{'mix':<8} {'round':>5} {'requests':>9} {'req/s':>9} {'mmfeatd us':>11} {'sweeps':>7} {'skipped':>8}"]
    for r in rows:
        cpu = f"{r['daemon_cpu_us']:>11.1f}" if r["daemon_cpu_us"] is not None else f"{'n/a':>11}"
        lines.append(f"{r['mix']:<8} {r['round'] + 1:>5} {r['requests']:>9} {r['requests'] / r['seconds']:>9.0f} "
                     f"{cpu} {r['sweeps']:>7} {r['skipped']:>8}")
    return "\n".join(lines)
