"""Control-plane benchmark: reserve + publish + ack round trips against a bare ZMQ msgpack echo.

Workers are separate processes that never import torch, so 16 of them start in a blink.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from mmfeat.protos.paths import control_endpoint, fd_socket_path


def _echo_server(endpoint: str, ready: Any, stop: Any) -> None:
    """The same loop shape as mmfeatd (poll, drain, decode, encode, reply) minus the daemon's work."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    ready.set()
    while not stop.is_set():
        if not poller.poll(100):
            continue
        while True:
            try:
                ident, body = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = msgpack.unpackb(body, raw=False)
            router.send_multipart([ident, msgpack.packb({"v": 1, "id": msg.get("id"), "ok": True}, use_bin_type=True)])
    router.close(0)
    ctx.term()


def _mmfeat_worker(runtime_dir: str, seconds: float, start: Any, out: Any) -> None:
    from mmfeat.client.link.channel import ControlChannel
    from mmfeat.client.link.fd_channel import open_fd_channel

    import os

    ch = ControlChannel(control_endpoint(Path(runtime_dir)), 5.0)
    hello = ch.call("hello", name="bench-control", pid=os.getpid())
    sock, fds, table_fd = open_fd_channel(fd_socket_path(Path(runtime_dir)), hello["session"], 5.0)
    for fd in (*fds.values(), table_fd):
        os.close(fd)
    rtts: list[float] = []
    cycles = 0
    start.wait()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        lease = ch.call("reserve", session=hello["session"], nbytes=4096, consumers=1)["lease"]
        t1 = time.monotonic()
        ch.call("publish", session=hello["session"], lease=lease)
        t2 = time.monotonic()
        ch.call("ack", lease=lease, count=1)
        t3 = time.monotonic()
        rtts += [t1 - t0, t2 - t1, t3 - t2]
        cycles += 1
    out.put((cycles, rtts))
    sock.close()
    ch.close()


def _echo_worker(endpoint: str, seconds: float, start: Any, out: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    rtts: list[float] = []
    n = 0
    start.wait()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        sock.send(msgpack.packb({"v": 1, "op": "echo", "id": n}, use_bin_type=True))
        sock.poll(5000)
        msgpack.unpackb(sock.recv(), raw=False)
        rtts.append(time.monotonic() - t0)
        n += 1
    out.put((n // 3, rtts))  # three round trips make one reserve+publish+ack cycle
    sock.close(0)
    ctx.term()


def _run_workers(target: Any, args: tuple, n: int, seconds: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, seconds, start, out)) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # let every worker connect before the clock starts
    start.set()
    results = [out.get(timeout=seconds + 30) for _ in procs]
    for p in procs:
        p.join(10)
    cycles = sum(r[0] for r in results)
    rtts = sorted(x for r in results for x in r[1])
    return {
        "cycles_per_s": cycles / seconds,
        "p50_us": statistics.median(rtts) * 1e6 if rtts else float("nan"),
        "p99_us": rtts[int(len(rtts) * 0.99)] * 1e6 if rtts else float("nan"),
    }


def run_control(runtime_dir: Path, sock_dir: Path, clients: list[int], seconds: float) -> list[dict[str, Any]]:
    """Rows of {clients, mmfeat cycles/s and RTT p50/p99, echo cycles/s and RTT p50/p99}."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    echo_ep = f"ipc://{sock_dir}/echo.sock"
    server = ctx.Process(target=_echo_server, args=(echo_ep, ready, stop))
    server.start()
    ready.wait(30)
    rows = []
    try:
        for n in clients:
            ours = _run_workers(_mmfeat_worker, (str(runtime_dir),), n, seconds)
            echo = _run_workers(_echo_worker, (echo_ep,), n, seconds)
            rows.append({"clients": n, "mmfeat": ours, "echo": echo})
    finally:
        stop.set()
        server.join(10)
    return rows
