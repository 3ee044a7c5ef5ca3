"""Bytes that cross the link when vLLM consumer instances on one node load items that a producer on
another node saved, through the connector's two halves in vLLM's call order (tests/vllm_roles.py) and
the mesh, each node in a network namespace of its own with UCX on TCP over the veth between them. The
table in docs/performance.md comes from here, and tests/test_vllm_mesh.py checks one row of it.

    sudo .venv/bin/python -m tests.xnode_bytes [--items 4] [--tokens 8192] [--ranks 1,2,4] [--instances 1,2]

Needs root and iproute2 (it says so and exits 3 otherwise). Each row: fresh items saved on node A, then
``instances`` consumer instances on node B, each with ``ranks`` loading ranks, load every item (every
rank checks every byte); ``veth_rx`` is what B's end of the veth received meanwhile, against what
designs that move an item once per loading rank would (ranks x instances x item bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from mmfeat.integrations.vllm import ConnectorSettings

from .vllm_roles import Engine, Feature, Request

RETAIN_S = 300.0  # past the whole run: the owner's items stay until it ends


def produce(ctx: Any, runtime_dir: str, hashes: list[str], settings: ConnectorSettings) -> list[dict]:
    """An encode-only instance on the owner's node saves every item, then exits: each request's
    ec_transfer_params, which name the item's descriptor for other nodes' consumers."""
    prod = Engine(runtime_dir, settings, producer=True, consumer=False, ctx=ctx)
    reqs = [Request(f"p-{h}", [Feature(h)]) for h in hashes]
    try:
        prod.step(reqs)
        params = prod.finish(reqs)
    finally:
        prod.close()
    assert all(p and "desc" in p[h]["mmfeat"] for p, h in zip(params, hashes)), f"no descriptors named: {params}"
    return params


def requests(hashes: list[str], params: list[dict], prefix: str) -> list[Request]:
    """A consumer's requests, one item each, whose params name where the producer saved it."""
    return [Request(f"{prefix}-{h}", [Feature(h)], p) for h, p in zip(hashes, params)]


def load_all(engines: list[Engine], waiting: list[list[Request]], timeout: float = 300.0,
             on_loads: Callable[[Engine, Any], None] = lambda engine, meta: None) -> int:
    """Step each instance in turn, so that one asks while another's pulls may still be under way, until
    every request loaded its item (its ranks check every byte); ``on_loads`` sees each step's metadata
    that has loads, before its ranks run. Returns the steps requests were deferred in."""
    deferred = 0
    deadline = time.monotonic() + timeout
    while any(waiting):
        assert time.monotonic() < deadline, f"requests still waiting after {timeout:g} s: {waiting}"
        for engine, reqs in zip(engines, waiting):
            if not reqs:
                continue
            meta, compute = engine.schedule(reqs)
            assert not compute, f"items the consumer would encode itself: {compute}"
            failed = engine.side.take_unavailable_requests()
            assert not failed, f"requests failed: {failed}"
            if not meta.loads:
                deferred += 1  # its ranks would run an empty step
                continue
            on_loads(engine, meta)
            report = engine.run(meta, compute)
            assert not report.failed, report.failed
            done = [r for r in reqs if r.mm_features[0].identifier in meta.loads]
            engine.finish(done)
            reqs[:] = [r for r in reqs if r not in done]
    return deferred


def consume(ctx: Any, runtime_dir: str, hashes: list[str], params: list[dict], settings: ConnectorSettings,
            ranks: int, instances: int) -> dict[str, int]:
    """``instances`` consumer instances, ``ranks`` loading ranks each, each loading every item: the loads
    the ranks checked byte for byte, and the steps requests were deferred in."""
    engines = [Engine(runtime_dir, settings, producer=False, consumer=True, ranks=ranks, ctx=ctx)
               for _ in range(instances)]
    try:
        deferred = load_all(engines, [requests(hashes, params, f"c{i}") for i in range(instances)])
    finally:
        checked = sum(engine.close() for engine in engines)
    return {"checked": checked, "deferred_steps": deferred}


def measure(ctx: Any, rt_a: str, rt_b: str, rx: Callable[[], int], tag: str, items: int, tokens: int,
            ranks: int, instances: int, **settings: Any) -> dict[str, int]:
    """One row: fresh items saved on A, loaded on B; what B received over the link meanwhile."""
    s = ConnectorSettings(retain_ttl_s=RETAIN_S, **settings)
    hashes = [f"{tag}-{i}@{tokens}" for i in range(items)]
    params = produce(ctx, rt_a, hashes, s)
    before = rx()
    out = consume(ctx, rt_b, hashes, params, s, ranks, instances)
    item_bytes = tokens * 256 * 2
    assert out["checked"] == items * ranks * instances, out
    return {"ranks": ranks, "instances": instances, "items": items, "item_bytes": item_bytes,
            "veth_rx": rx() - before, "per_rank_design": ranks * instances * items * item_bytes, **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192, help="per item, 512 bytes each (8192: 4 MiB)")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--instances", default="1,2")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()

    from mmfeat.bench.netns import TCP_ENV, make_pair, remove_pair
    from mmfeat.testing import spawn_mesh, worker_context

    try:
        pair = make_pair("mmfx")
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"xnode_bytes: two network namespaces joined by a veth cannot be made here (needs root and "
              f"iproute2): {exc}", file=sys.stderr)
        return 3
    work = Path(tempfile.mkdtemp(prefix="mmf-xnode-"))
    nodes: dict = {}
    try:
        names = ("xa", "xb")
        nodes = spawn_mesh(work, names, ["--backend", "host", "--pool-mb", "256", "--log-level", "WARNING"],
                           hosts=dict(zip(names, pair.addrs)), wraps={n: pair.prefix(i) for i, n in enumerate(names)},
                           env={**os.environ, **TCP_ENV})
        ctx = worker_context()
        rows = []
        for r in (int(x) for x in args.ranks.split(",")):
            for n in (int(x) for x in args.instances.split(",")):
                row = measure(ctx, str(nodes["xa"][0]), str(nodes["xb"][0]), lambda: pair.veth_bytes(1)[0],
                              f"r{r}i{n}", args.items, args.tokens, r, n)
                rows.append(row)
                print(json.dumps(row), flush=True)
        print("\n| loading ranks | instances | bytes over the link | per item | a copy per loading rank |")
        print("|---|---|---|---|---|")
        for row in rows:
            total = row["items"] * row["item_bytes"]
            print(f"| {row['ranks']} | {row['instances']} | {row['veth_rx'] / 2**20:.1f} MiB | "
                  f"{row['veth_rx'] / total:.2f} x | {row['per_rank_design'] / 2**20:.1f} MiB |")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        for _, proc in nodes.values():
            proc.terminate()
            proc.wait(30)
        remove_pair(pair)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
