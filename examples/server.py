"""A server-shaped run: a tokenizer process with a real Hugging Face image processor, and N scheduler
ranks, moving the same requests first as plain pickles and then through mmfeat. Both in one run.

The shape is SGLang's: the tokenizer process turns each request's images into ``pixel_values`` and
``image_grid_thw`` (the Qwen2-VL processor from ``transformers``) and sends the request object over
ZeroMQ to rank 0; rank 0 forwards it to the other tensor-parallel ranks, and every rank needs every
image. The two modes differ in two lines:

    pickle:  sock.send_pyobj(req)                          req = sock.recv_pyobj()
    mmfeat:  sock.send(dumps(req, consumers=tp))           with loads(sock.recv()) as req: ...

Images are made here from a seed (no downloads); every rank hashes the pixel values it received and
the run fails unless they match the tokenizer's. Needs the ``[examples]`` extra (transformers, pillow).

With ``--nodes 2`` the ranks are split over two daemons meshed on this machine, as tensor parallelism
across two nodes is (ranks 0..tp/2-1 with the tokenizer on the first): the second node's ranks get
each feature pulled into their own daemon's pool (``mmfeat[mesh]``) and their acks relayed, with the
same two lines of code. Needs ``mmfeat[mesh]``.

    python examples/server.py --requests 200 --tp 2
    python examples/server.py --requests 100 --tp 2 --nodes 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import zmq

from mmfeat.client import Client, dumps, loads
from mmfeat.testing import DaemonStartError, spawn_daemon, spawn_mesh

SIDES = (224, 336, 448, 560, 672)  # square images; Qwen2-VL patches them at 14 px, merges 2x2
MODES = ("pickle", "mmfeat")


@dataclass
class Request:
    """What a tokenizer sends a scheduler: ids and the processor's output, like SGLang's
    TokenizedGenerateReqInput with its mm_inputs."""

    rid: int
    input_ids: list[int]
    mm_inputs: dict[str, Any]
    sampling: dict[str, Any] = field(default_factory=lambda: {"max_new_tokens": 128, "temperature": 0.0})


def _processor() -> Any:
    try:  # transformers 5 names the PIL-only processor; it needs no torchvision
        from transformers import Qwen2VLImageProcessorPil as Processor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Processor
    return Processor()


def _images(rid: int, max_images: int) -> list[Any]:
    from PIL import Image

    rng = random.Random(rid)
    out = []
    for _ in range(rng.randint(1, max_images)):
        side = rng.choice(SIDES)
        pixels = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (side, side, 3), dtype=np.uint8)
        out.append(Image.fromarray(pixels))
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def tokenizer(mode: str, endpoint: str, runtime_dir: str, n: int, tp: int, max_images: int, window: int,
              out: Any) -> None:
    processor = _processor()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.sndhwm = window  # back-pressure from rank 0, as a real server's bounded queue gives
    push.connect(endpoint)
    client = Client(runtime_dir) if mode == "mmfeat" else None
    if client is not None:
        client.connect()
    digests, started, ready = [], [], []
    send_cpu = 0.0
    cpu0 = time.process_time()
    for rid in range(n):
        started.append(time.monotonic())
        features = dict(processor(images=_images(rid, max_images), return_tensors="pt"))
        tokens = int(features["image_grid_thw"].prod(dim=1).sum()) // 4
        req = Request(rid, list(range(tokens + 16)), features)
        ready.append(time.monotonic())
        c0 = time.process_time()
        if client is None:
            push.send_pyobj(req)
        else:
            push.send(dumps(req, consumers=tp, client=client))
        send_cpu += time.process_time() - c0
        digests.append(_digest(features["pixel_values"]))  # the reference; kept out of send_cpu
    push.send(b"")  # end of stream
    cpu = time.process_time() - cpu0
    if client is not None:
        client.close()
    push.close(linger=5000)
    ctx.term()
    out.put({"role": "tokenizer", "digests": digests, "started": started, "ready": ready, "cpu": cpu,
             "transport_cpu": send_cpu})


def rank(mode: str, r: int, endpoints: list[str], runtime_dir: str, out: Any) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoints[r])
    forward = []
    if r == 0:  # rank 0 hands every request on to the other ranks, as SGLang's broadcast does
        for e in endpoints[1:]:
            s = ctx.socket(zmq.PUSH)
            s.connect(e)
            forward.append(s)
    client = Client(runtime_dir) if mode == "mmfeat" else None
    if client is not None:
        client.connect()
    arrived, digests = {}, {}
    transport_cpu = 0.0
    cpu0 = time.process_time()
    while True:
        data = pull.recv()
        c0 = time.process_time()
        for s in forward:
            s.send(data)
        if not data:
            break
        if client is None:
            req = pickle.loads(data)
            transport_cpu += time.process_time() - c0
            arrived[req.rid] = time.monotonic()
            digests[req.rid] = _digest(req.mm_inputs["pixel_values"])
        else:
            with loads(data, client=client) as req:  # zero-copy views; acked on leaving the block
                transport_cpu += time.process_time() - c0
                arrived[req.rid] = time.monotonic()
                digests[req.rid] = _digest(req.mm_inputs["pixel_values"])  # the "model" reads every byte
    cpu = time.process_time() - cpu0
    if client is not None:
        client.close()
    for s in [pull, *forward]:
        s.close(linger=5000)
    ctx.term()
    out.put({"role": f"rank{r}", "digests": digests, "arrived": arrived, "cpu": cpu, "transport_cpu": transport_cpu})


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def run_mode(mode: str, args: argparse.Namespace, runtime_dirs: list[Path], daemon_pids: list[int]) -> dict[str, Any]:
    """``runtime_dirs``: one daemon per node; rank r runs on node r * nodes // tp, the tokenizer on the first."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    nodes = len(runtime_dirs)
    endpoints = [f"ipc://{runtime_dirs[0]}/example-{mode}-rank{r}" for r in range(args.tp)]
    ranks = [ctx.Process(target=rank, args=(mode, r, endpoints, str(runtime_dirs[r * nodes // args.tp]), out))
             for r in range(args.tp)]
    tok = ctx.Process(target=tokenizer, args=(mode, endpoints[0], str(runtime_dirs[0]), args.requests, args.tp,
                                              args.max_images, args.window, out))
    daemon_cpu0 = sum(_proc_cpu(pid) for pid in daemon_pids)
    for p in [*ranks, tok]:
        p.start()
    results = {}
    try:
        for _ in range(args.tp + 1):
            r = out.get(timeout=args.timeout)
            results[r["role"]] = r
    finally:
        for p in [*ranks, tok]:
            p.join(30)
            if p.is_alive():
                p.kill()
    daemon_cpu = sum(_proc_cpu(pid) for pid in daemon_pids) - daemon_cpu0
    t = results["tokenizer"]
    n = args.requests
    for r in range(args.tp):
        got = results[f"rank{r}"]["digests"]
        bad = [rid for rid in range(n) if got.get(rid) != t["digests"][rid]]
        if bad:
            raise SystemExit(f"{mode}: rank {r} saw different pixel values for requests {bad[:10]}")
    last = [max(results[f"rank{r}"]["arrived"][rid] for r in range(args.tp)) for rid in range(n)]
    transport = [(last[i] - t["ready"][i]) * 1e3 for i in range(n)]
    total = [(last[i] - t["started"][i]) * 1e3 for i in range(n)]
    row = {
        "mode": mode, "requests": n, "tp": args.tp, "nodes": nodes,
        "req_per_s": n / (max(last) - t["started"][0]),
        "transport_ms_p50": _pct(transport, 50), "transport_ms_p99": _pct(transport, 99),
        "e2e_ms_p50": _pct(total, 50), "e2e_ms_p99": _pct(total, 99),
        "cpu_ms_per_req": {"tokenizer": t["cpu"] / n * 1e3,
                           **{f"rank{r}": results[f"rank{r}"]["cpu"] / n * 1e3 for r in range(args.tp)},
                           "mmfeatd": daemon_cpu / n * 1e3},
        "transport_cpu_ms_per_req": {"tokenizer": t["transport_cpu"] / n * 1e3,
                                     **{f"rank{r}": results[f"rank{r}"]["transport_cpu"] / n * 1e3
                                        for r in range(args.tp)}},
        "identical": True,
    }
    return row


def _pool_left(runtime_dirs: list[Path], patience: float = 15.0) -> int:
    """Bytes still used in the daemons' pools once every feature, and every copy another node pulled, had
    time to go: acks relayed across nodes and the owner's word that a feature ended arrive a little later."""
    deadline = time.monotonic() + patience
    while True:
        left = 0
        for rt in runtime_dirs:
            with Client(rt) as c:
                left += c.stats()["pools"][0]["used"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _table(rows: list[dict[str, Any]]) -> str:
    procs = list(rows[0]["cpu_ms_per_req"])
    lines = [f"{'mode':<7} {'req/s':>6} {'transport ms p50 / p99':>22} {'end-to-end ms p50 / p99':>24}   "
             "CPU ms per request, all (transport): " + ", ".join(procs)]
    for r in rows:
        cpu = ", ".join(f"{r['cpu_ms_per_req'][p]:.1f}"
                        + (f" ({r['transport_cpu_ms_per_req'][p]:.2f})"
                           if p in r["transport_cpu_ms_per_req"] else "") for p in procs)
        lines.append(f"{r['mode']:<7} {r['req_per_s']:>6.1f} "
                     f"{r['transport_ms_p50']:>11.2f} / {r['transport_ms_p99']:<8.2f} "
                     f"{r['e2e_ms_p50']:>12.1f} / {r['e2e_ms_p99']:<9.1f}   {cpu}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tp", type=int, default=2, help="scheduler ranks; each needs every image")
    ap.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                    help="2: the ranks split over two daemons meshed on this machine (needs mmfeat[mesh])")
    ap.add_argument("--max-images", type=int, default=4, help="images per request: 1 to this many")
    ap.add_argument("--window", type=int, default=8, help="requests the tokenizer may have queued ahead of rank 0")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--runtime-dir", type=Path, help="an mmfeatd that is already running (default: start one)")
    ap.add_argument("--pool-mb", type=int, default=1024, help="pool of the daemon this starts")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a mode may take")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES) or args.tp < 1 or args.requests < 1:
        ap.error(f"--modes is a list of {MODES}; --tp and --requests are positive")
    if args.nodes > 1 and (args.runtime_dir is not None or args.tp < args.nodes):
        ap.error("--nodes 2 starts its own two daemons (no --runtime-dir) and needs --tp 2 or more")
    # Under /tmp, not $TMPDIR: a socket path must fit AF_UNIX's 108 bytes. It holds the daemons' sockets
    # and, with --nodes 2, their mesh secret keys: removed however the run ends.
    work = Path(tempfile.mkdtemp(prefix="mmfeat-server-", dir="/tmp"))
    print(f"[server] work dir: {work} (removed at the end)", flush=True)
    try:
        return _serve(args, modes, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _serve(args: argparse.Namespace, modes: list[str], work: Path) -> int:
    daemons = []
    try:
        if args.runtime_dir is not None:
            runtime_dirs = [args.runtime_dir]
        elif args.nodes == 1:
            runtime_dirs = [work]
            daemons = [spawn_daemon(work, ["--pool-mb", str(args.pool_mb)])]
        else:
            mesh = spawn_mesh(work, ("node0", "node1"), ["--backend", "host", "--pool-mb", str(args.pool_mb)])
            runtime_dirs, daemons = [rt for rt, _ in mesh.values()], [proc for _, proc in mesh.values()]
    except DaemonStartError as exc:
        print(f"server: {exc}", file=sys.stderr)
        return 1
    try:
        daemon_pids = []
        for rt in runtime_dirs:
            with Client(rt) as c:
                daemon_pids.append(c.stats()["pid"])
        rows = [run_mode(m, args, runtime_dirs, daemon_pids) for m in modes]
        left = _pool_left(runtime_dirs) if args.runtime_dir is None else None
        pulls = 0
        for rt in runtime_dirs[1:]:  # what the other nodes' daemons pulled from the first
            with Client(rt) as c:
                pulls += sum(p["pulls"] for p in c.stats()["mesh"]["peers"])
    finally:
        for daemon in daemons:
            daemon.send_signal(signal.SIGTERM)
        for daemon in daemons:
            daemon.wait(30)
    print(f"{args.requests} requests of 1-{args.max_images} images ({'/'.join(map(str, SIDES))} px), TP={args.tp}"
          f"{f' over {args.nodes} nodes' if args.nodes > 1 else ''}; "
          "every rank's pixel values identical to the tokenizer's")
    print(_table(rows))
    if args.nodes > 1:
        print(f"node1's daemon pulled {pulls} features from node0's")
    if left:
        print(f"server: {left} bytes still in the pool after every request was acked", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "pool_used_after": left, "pulls": pulls}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
