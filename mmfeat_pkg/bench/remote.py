"""``mmfeat bench --remote``: features pulled across nodes, against the bare transfer they are made of.

Two private daemons on 127.0.0.1 play two nodes, meshed over CURVE. In one invocation, per size:
- remote: a producer process puts into node A's pool, a consumer process on node B gets each feature
  (its daemon pulls it with NIXL and checks it with A), reads every byte and acks (relayed to A);
- remote_premade: the same gets of features the producer put before the clock started, a batch at a
  time: the pull alone, as on two machines, where the producer's copies run on the other node's CPUs
  (here they would share the same cores with the pulls);
- nixl_read: the bare NIXL READ of the same bytes between two processes, each read then read through
  once, as the consumer does: what a pull is made of, the ceiling for `remote`. Each READ moves a
  feature of its own, from and into a ring of buffers (registered once, like a daemon's pool), because
  a stream of features is never the same memory twice;
- nixl_read_hot: the same READ of one buffer over and over, which caches keep warm (flatters the bare
  READ by 20-40% here; kept so that earlier runs, which used it as the baseline, can be compared);
- zmq_tcp: the bytes over a plain ZeroMQ TCP socket (what a server sends without mmfeat);
- remote_prefetch: the same, but the consumer prefetches every descriptor it has received before it
  gets the first of them, as a scheduler does with a batch: pulls overlap the consumer's work;
- local: the same producer and a consumer on node A, for the latency a remote get adds.
Descriptors travel producer -> consumer over ZeroMQ TCP, as they would in a server's own messages.

With ``--netns`` (root) each node is a network namespace of its own, joined to the other by a veth
(mmfeat_pkg/bench/netns.py), and every process of a node runs in its namespace with UCX on TCP: the pulls,
the bare READ and the ZeroMQ bytes cross the veth as they would cross a network without RDMA (on one
host UCX otherwise reads through cross-memory attach). Each row then has ``veth_bytes``: what the
consumer's node received over the veth during it.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import msgpack
import zmq

from mmfeat.testing import worker_context

from .netns import TCP_ENV, NetnsPair, make_pair, remove_pair
from .remote_verdict import REMOTE_ROUNDS, verdict
from .report import MiB, combine_rounds, human_size, parse_size

REMOTE_MODES = ("remote", "remote_prefetch", "remote_premade", "local", "nixl_read", "nixl_read_hot", "zmq_tcp")
_POOL_MODES = ("remote", "remote_prefetch", "remote_premade", "local")
WINDOW = 4
WARMUP = 5  # features (or reads) before the clock starts: connections, mappings, first touches
_RING_BYTES = 256 * MiB  # nixl_read's ring of buffers, on either side, at most


def _premade_batches(count: int, size: int, pool_bytes: int) -> list[int]:
    """How many features remote_premade puts at a time: a warm-up batch, then batches that fit in a
    quarter of the pool (the copies on the consumer's node take as much again)."""
    step = max(1, min(32, pool_bytes // 4 // size))
    rest = count - WARMUP
    return [WARMUP] + [min(step, rest - i) for i in range(0, rest, step)]


def _port() -> int:
    from mmfeat.testing import free_tcp_port

    return free_tcp_port()


# Where a worker runs: None on the host as it is, else (pair, i): in the pair's namespace i.
Where = Optional[tuple[NetnsPair, int]]


def _nodes(work: Path, pool_mb: int, pair: Optional[NetnsPair]) -> dict[str, tuple[Path, subprocess.Popen]]:
    """Daemons "bench-a" and "bench-b", each listing the other, both answering, both seeing the other up;
    with a pair, each in its namespace with UCX on TCP."""
    from mmfeat.testing import spawn_mesh

    args = ["--backend", "host", "--pool-mb", str(pool_mb), "--log-level", "WARNING"]
    if pair is None:
        return spawn_mesh(work, ("bench-a", "bench-b"), args)
    names = ("bench-a", "bench-b")
    return spawn_mesh(work, names, args, hosts=dict(zip(names, pair.addrs)),
                      wraps={n: pair.prefix(i) for i, n in enumerate(names)}, env={**os.environ, **TCP_ENV})


def _enter(where: Where) -> str:
    """Move this worker into its node's namespace, if any; the node's address."""
    if where is None:
        return "127.0.0.1"
    pair, i = where
    pair.enter(i)
    return pair.addrs[i]


def _read_every_byte(buf: Any) -> int:
    import torch

    t = buf if isinstance(buf, torch.Tensor) else torch.frombuffer(buf, dtype=torch.uint8)
    return int(t.view(torch.int64).sum()) if t.numel() % 8 == 0 else int(t.sum())


def _producer(mode: str, runtime_dir: str, port: int, done_port: int, size: int, count: int, batches: list[int],
              out: Any, where: Where = None) -> None:
    import torch

    from mmfeat.client import Client

    host = _enter(where)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.bind(f"tcp://{host}:{port}")
    done = ctx.socket(zmq.PULL)
    done.bind(f"tcp://{host}:{done_port}")
    payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
    client = Client(runtime_dir, inline_threshold=0, fallback="error") if mode in _POOL_MODES else None
    if client is not None:
        client.connect()
    sent = acked = 0
    for n in batches if mode == "remote_premade" else []:
        descs = [client.put(payload).to_bytes() for _ in range(n)]
        for body in descs:
            push.send_multipart([msgpack.packb(sent), body])
            sent += 1
        done.recv()
        acked = sent
    while acked < count:
        while sent < count and sent - acked < WINDOW:
            if client is not None:
                push.send_multipart([msgpack.packb(sent), client.put(payload).to_bytes()])
            else:
                push.send_multipart([msgpack.packb(sent), payload.numpy()], copy=False)
            sent += 1
        done.recv()
        acked += 1
    if client is not None:
        client.close()
    push.close(0)
    done.close(0)
    ctx.term()


def _consumer(mode: str, runtime_dir: str, port: int, done_port: int, count: int, batches: list[int], out: Any,
              where: Where = None, producer_host: str = "127.0.0.1") -> None:
    import torch  # before the clock starts

    torch.set_num_threads(1)

    from mmfeat.client import Client
    from mmfeat.protos.descriptor import Descriptor

    _enter(where)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"tcp://{producer_host}:{port}")
    done = ctx.socket(zmq.PUSH)
    done.connect(f"tcp://{producer_host}:{done_port}")
    client = Client(runtime_dir) if mode in _POOL_MODES else None
    if client is not None:
        client.connect()
    get_s: list[float] = []
    if mode == "remote_premade":
        elapsed = 0.0
        for k, n in enumerate(batches):
            descs = [Descriptor.from_bytes(pull.recv_multipart()[1]) for _ in range(n)]
            t0 = time.monotonic()  # the batch is made and its descriptors are here: only the pulls are timed
            for desc in descs:
                g0 = time.monotonic()
                got = client.get(desc)
                if k:
                    get_s.append(time.monotonic() - g0)
                _read_every_byte(got)
                del got
                client.ack(desc)
            if k:
                elapsed += time.monotonic() - t0
            done.send(b"")
        _finish(client, pull, done, out, elapsed, get_s)
        return
    waiting: list[Any] = []  # received, prefetched, not read yet
    t0 = time.monotonic()
    for i in range(count):
        if i == WARMUP:
            t0, get_s = time.monotonic(), []
        if mode == "remote_prefetch":
            while pull.poll(0 if waiting else None):
                desc = Descriptor.from_bytes(pull.recv_multipart()[1])
                client.prefetch(desc)
                waiting.append(desc)
            body = None
        else:
            _, body = pull.recv_multipart(copy=False)
        if client is not None:
            desc = waiting.pop(0) if body is None else Descriptor.from_bytes(body.bytes)
            g0 = time.monotonic()
            got = client.get(desc)
            get_s.append(time.monotonic() - g0)
            _read_every_byte(got)
            del got
            client.ack(desc)
        else:
            _read_every_byte(body.buffer)
        done.send(b"")
    _finish(client, pull, done, out, time.monotonic() - t0, get_s)


def _finish(client: Any, pull: Any, done: Any, out: Any, elapsed: float, get_s: list[float]) -> None:
    if client is not None:
        client.flush()
        client.close()
    out.put((elapsed, get_s))
    pull.close(0)
    done.close(0)
    pull.context.term()


def _nixl_owner(size: int, ring: int, meta_q: Any, stop_q: Any, where: Where = None) -> None:
    from mmfeat.nixl import load_nixl, make_agent

    _enter(where)
    api = load_nixl()
    fd = os.memfd_create("bench")
    os.ftruncate(fd, size * ring)
    mm = mmap.mmap(fd, size * ring)
    chunk = os.urandom(min(size, MiB))
    for at in range(0, size * ring, len(chunk)):  # every page written, as a producer's features are
        mm[at:at + len(chunk)] = chunk[:size * ring - at]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    agent = make_agent(api, "bench-owner")  # set up as the daemon's are
    agent.register_memory([(addr, size * ring, 0, "bench")], "DRAM")
    meta_q.put((agent.get_agent_metadata(), addr))
    stop_q.get()


def _nixl_reader(size: int, ring: int, count: int, meta_q: Any, out: Any, where: Where = None) -> None:
    import torch  # before the clock starts

    torch.set_num_threads(1)

    from mmfeat.nixl import load_nixl, make_agent

    _enter(where)
    api = load_nixl()
    metadata, remote_addr = meta_q.get(timeout=60)
    fd = os.memfd_create("bench")
    os.ftruncate(fd, size * ring)
    mm = mmap.mmap(fd, size * ring, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)  # as the daemon maps its pool
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    agent = make_agent(api, "bench-reader")
    agent.register_memory([(addr, size * ring, 0, "")], "DRAM")
    name = agent.add_remote_agent(metadata)
    local = [agent.get_xfer_descs([(addr + k * size, size, 0)], "DRAM") for k in range(ring)]
    remote = [agent.get_xfer_descs([(remote_addr + k * size, size, 0)], "DRAM") for k in range(ring)]
    view = memoryview(mm)
    t0 = time.monotonic()
    for i in range(count):
        if i == WARMUP:
            t0 = time.monotonic()
        k = i % ring
        handle = agent.initialize_xfer("READ", local[k], remote[k], name)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise SystemExit("bare NIXL READ failed")
        agent.release_xfer_handle(handle)
        _read_every_byte(view[k * size:(k + 1) * size])
    out.put((time.monotonic() - t0, []))
    del view


def _run_mode(mode: str, nodes: dict, size: int, count: int, pool_bytes: int,
              pair: Optional[NetnsPair] = None) -> dict[str, Any]:
    ctx = worker_context()
    out = ctx.Queue()
    (rt_a, _), (rt_b, _) = nodes["bench-a"], nodes["bench-b"]
    on_a, on_b = ((pair, 0), (pair, 1)) if pair is not None else (None, None)
    received = pair.veth_bytes(1)[0] if pair is not None else 0
    if mode in ("nixl_read", "nixl_read_hot"):
        ring = 1 if mode == "nixl_read_hot" else max(1, min(count, _RING_BYTES // size))
        meta_q, stop_q = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=_nixl_owner, args=(size, ring, meta_q, stop_q, on_a)),
                 ctx.Process(target=_nixl_reader, args=(size, ring, count, meta_q, out, on_b))]
        for p in procs:
            p.start()
        elapsed, get_s = out.get(timeout=600)
        stop_q.put(None)
    else:
        port, done_port = _port(), _port()
        consumer_rt, consumer_at = (rt_a, on_a) if mode == "local" else (rt_b, on_b)
        batches = _premade_batches(count, size, pool_bytes)
        producer_host = pair.addrs[0] if pair is not None else "127.0.0.1"
        procs = [ctx.Process(target=_producer,
                             args=(mode, str(rt_a), port, done_port, size, count, batches, out, on_a)),
                 ctx.Process(target=_consumer, args=(mode, str(consumer_rt), port, done_port, count, batches, out,
                                                     consumer_at, producer_host))]
        for p in procs:
            p.start()
        elapsed, get_s = out.get(timeout=600)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    timed = count - WARMUP
    row = {"mode": mode, "size": size, "count": timed, "features_per_s": timed / elapsed,
           "gb_per_s": timed * size / elapsed / 1e9}
    if get_s:
        row["get_p50_us"] = statistics.median(get_s) * 1e6
    if pair is not None:
        row["veth_bytes"] = pair.veth_bytes(1)[0] - received
    return row


def ratios_to_nixl_read(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's features/s over the bare NIXL READ's of its size and round (a slow stretch of the
    machine moves both sides of a ratio taken within one round), then one row per mode and size: the
    medians of its rounds, with the lowest and highest round's ratio."""
    base = {(r["size"], r["round"]): r["features_per_s"] for r in rows if r["mode"] == "nixl_read"}
    for r in rows:
        b = base.get((r["size"], r["round"]))
        r["x_nixl_read"] = r["features_per_s"] / b if b else None
    return combine_rounds(rows, keys=("mode", "size"), spread=("x_nixl_read",))


def run_remote_bench(args: argparse.Namespace) -> int:
    args.rounds = args.rounds or REMOTE_ROUNDS
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="mmfbr-", dir="/tmp"))
    nodes: dict = {}
    pair: Optional[NetnsPair] = None
    try:
        if getattr(args, "netns", False):
            try:
                pair = make_pair()
            except (OSError, subprocess.SubprocessError) as exc:
                raise SystemExit(f"mmfeat bench --remote --netns: cannot make two network namespaces and a veth "
                                 f"(run as root, with iproute2's ip): {exc}") from None
        pool_mb = max(256, 32 * max(sizes) // MiB)
        nodes = _nodes(work, pool_mb, pair)
        rows = []
        modes = [m for m in args.modes.split(",") if m in REMOTE_MODES] or list(REMOTE_MODES)
        for rnd, size, mode in ((rnd, size, mode) for rnd in range(args.rounds) for size in sizes for mode in modes):
            count = WARMUP + (args.count or max(20, min(500, (512 * MiB) // size)))
            print(f"bench --remote: {human_size(size)} {mode}"
                  f"{f', round {rnd + 1}/{args.rounds}' if args.rounds > 1 else ''} ...",
                  flush=True, file=sys.stderr)
            rows.append({**_run_mode(mode, nodes, size, count, pool_mb * MiB, pair), "round": rnd})
        rows = ratios_to_nixl_read(rows)
        if args.rounds > 1:
            print(f"medians of {args.rounds} interleaved rounds (ratios: of each round its own)")
        print(_render(rows, args.targets, pair is not None))
        if args.json:
            import json

            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    finally:
        for _, proc in nodes.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
        if pair is not None:
            remove_pair(pair)
        shutil.rmtree(work, ignore_errors=True)


def _render(rows: list[dict[str, Any]], goals: bool = False, netns: bool = False) -> str:
    where = ("two daemons in network namespaces joined by a veth, UCX on TCP" if netns
             else "two daemons on 127.0.0.1 as nodes (UCX: cross-memory attach)")
    lines = [f"{where}; consumers read every byte; window 4",
             f"{'size':>6} {'mode':<15} {'feat/s':>9} {'GB/s':>7} {'x nixl_read':>12} {'get p50 us':>11}"
             + (f" {'veth MiB':>9}" if netns else "")]
    verdicts, goal_lines = [], []
    for size in sorted({r["size"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["size"] == size}
        for r in by.values():
            ratio = f"{r['x_nixl_read']:.2f}x" if r.get("x_nixl_read") is not None else "-"
            p50 = f"{r['get_p50_us']:.0f}" if "get_p50_us" in r else "-"
            veth = f" {r['veth_bytes'] / MiB:>9.1f}" if netns else ""
            lines.append(f"{human_size(size):>6} {r['mode']:<15} {r['features_per_s']:>9.0f} {r['gb_per_s']:>7.2f} "
                         f"{ratio:>12} {p50:>11}{veth}")
        if "remote" in by and "local" in by and "get_p50_us" in by["remote"] and "get_p50_us" in by["local"]:
            verdicts.append(f"{human_size(size)}: a remote get adds "
                            f"{by['remote']['get_p50_us'] - by['local']['get_p50_us']:.0f} "
                            f"us at p50 over a local one")
        if goals and size == 16 * MiB:
            goal_lines += ["  " + verdict(mode, by[mode]) for mode in ("remote", "remote_prefetch", "remote_premade")
                           if by.get(mode, {}).get("x_nixl_read") is not None]
    if goal_lines:
        verdicts += ["", "the project's reference goals (set for its reference machine, docs/performance.md):",
                     *goal_lines]
    return "\n".join(lines + [""] + verdicts)
