"""Producer and consumer processes of the data-plane benchmark.

One producer and N consumers live for a whole consumer-count run; the parent sends them one command per
(mode, size). Descriptors (or payloads, for the zmq_bytes mode) go producer -> each consumer over ZMQ
PUSH/PULL, as they would in a server's own messages; each consumer reads every byte, acks, and reports
(feature, time read) back on a PULL socket the producer owns, which also enforces the in-flight window.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from mmfeat.protos.descriptor import Descriptor

# floor: the descriptor-sized message and the read of a local tensor, no transport at all; what any
# transport adds is its distance from this row.
MODES = ("floor", "shm_ring", "pool_view", "pool_copy", "inline", "zmq_bytes", "torch_mp", "client_default")
_FLOOR_MESSAGE = bytes(200)  # about a one-tensor descriptor
# shm_ring: the least a shared-memory transport can cost. The producer copies each feature into slot
# i % window of a plain shared-memory file and sends the slot number with the floor's message; consumers
# read the slot in place. No leases, acks, checks or daemon: the in-flight window alone keeps a slot from
# being overwritten while it is read. What the pool adds over this row is its bookkeeping.
_SHM_DIR = "/dev/shm"
POOL_MODES = {"pool_view", "pool_copy", "client_default"}
# Modes whose descriptor may carry the payload itself, so their consumers receive it as zmq_bytes does.
_PAYLOAD_MODES = {"client_default", "inline"}


@dataclass(frozen=True)
class Job:
    mode: str
    size: int
    count: int
    warmup: int
    window: int
    # "cpu" for a host pool; "cuda:N" for a GPU pool, where features start and end in HBM and the
    # modes without a GPU path (zmq_bytes, inline) pay the host round trip a server would.
    device: str = "cpu"
    # "background": ack(wait=False), as a server acks once it has used a feature; "sync": wait for it.
    ack: str = "background"
    # The consumer takes every descriptor after the warm-up before it reads any: its producer ran ahead.
    burst: bool = False


def read_every_byte(t: Any) -> int:
    """Touch every byte, the same work in every mode: an int64 sum over the feature."""
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    if flat.numel() % 8 == 0:
        return int(flat.view(torch.int64).sum())
    return int(flat.sum())


def ring_path(sock_dir: str) -> str:
    base = _SHM_DIR if os.path.isdir(_SHM_DIR) else sock_dir
    return os.path.join(base, f"{os.path.basename(sock_dir)}-ring")


def _ring(path: str, nbytes: int, create: bool) -> Any:
    """The ring as a uint8 tensor over a MAP_SHARED mapping of ``path`` (made ``nbytes`` long if ``create``)."""
    import torch

    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
    ring = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    if create:
        ring.zero_()  # its pages allocated before the clock starts, as the daemon populates its pool at start
    return ring


def _client(runtime_dir: str, mode: str) -> Any:
    from mmfeat.client.client import Client

    if mode == "inline":
        return Client(runtime_dir, inline_threshold=1 << 62)
    client = (Client(runtime_dir) if mode == "client_default"
              else Client(runtime_dir, inline_threshold=0, fallback="error"))
    client.connect()  # a server connects once at startup: mapping the pool is not a per-feature cost
    return client


def _client_for(clients: dict[str, Any], runtime_dir: str, mode: str) -> Any:
    """The mode's client, made once; the other modes' clients are closed, as a server has one client,
    so that their arenas do not hold pool space another mode's run needs, and a mode that uses no
    daemon runs with none attached (its mmfeatd column is then a daemon nobody uses, not one idling
    with clients)."""
    for other in [m for m in clients if m != mode]:
        clients.pop(other).close()
    if mode not in POOL_MODES and mode != "inline":
        return None
    return clients.get(mode) or clients.setdefault(mode, _client(runtime_dir, mode))


def consumer_main(rank: int, runtime_dir: str, sock_dir: str, threads: int, cmd: Any, mp_queue: Any) -> None:
    import torch

    torch.set_num_threads(threads)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"ipc://{sock_dir}/feat-{rank}.sock")
    done = ctx.socket(zmq.PUSH)
    done.connect(f"ipc://{sock_dir}/done.sock")
    clients: dict[str, Any] = {}
    while (job := cmd.recv()) is not None:
        total = job.count + job.warmup
        client = _client_for(clients, runtime_dir, job.mode)
        local = torch.randint(0, 255, (job.size,), dtype=torch.uint8).to(job.device) if job.mode == "floor" else None
        ring = None  # shm_ring: mapped at the first feature, once the producer has made it
        ahead: list = []
        cpu0 = time.process_time()
        for k in range(total):
            if k == job.warmup:
                # Connected, warmed up: CPU per feature from here (all threads: ZeroMQ's I/O thread and
                # the background acker too), as a server that connected once pays it.
                cpu0 = time.process_time()
            # Each mode holds the feature as a tensor on the job's device (held_at), then reads every byte.
            if job.mode == "floor":
                header, _ = pull.recv_multipart()
                idx, got = msgpack.unpackb(header), local
            elif job.mode == "shm_ring":
                header, slot = pull.recv_multipart()
                idx, at = msgpack.unpackb(header), int(slot) * job.size
                if ring is None:
                    ring = _ring(ring_path(sock_dir), job.size * job.window, create=False)
                got = ring[at : at + job.size].to(job.device)
            elif job.mode == "torch_mp":
                idx, got = mp_queue.get()
            elif job.mode == "zmq_bytes":
                header, payload = pull.recv_multipart(copy=False)
                idx = msgpack.unpackb(header.bytes)
                got = torch.frombuffer(payload.buffer, dtype=torch.uint8).to(job.device)
            elif job.mode in _PAYLOAD_MODES:
                # A message that may carry the payload (an inline descriptor) is received without a copy
                # and read in place, as zmq_bytes reads its payload.
                header, blob = pull.recv_multipart(copy=False)
                idx = msgpack.unpackb(header.bytes)
                desc = Descriptor.from_bytes(blob)  # once, as a server unpacks its own message once
                got = client.get(desc).to(job.device)
            else:
                if job.burst and k == job.warmup:
                    ahead = [pull.recv_multipart() for _ in range(job.count)]  # a burst: all put before any read
                header, blob = ahead.pop(0) if job.burst and k >= job.warmup else pull.recv_multipart()
                idx = msgpack.unpackb(header)
                desc = Descriptor.from_bytes(blob)
                got = client.get(desc, copy=(job.mode == "pool_copy")).to(job.device)  # inline on a GPU run: a copy
            held_at = time.monotonic()
            read_every_byte(got)
            del got
            if job.mode in POOL_MODES or job.mode == "inline":
                client.ack(desc, wait=(job.ack == "sync"))
            done.send(msgpack.packb([idx, held_at, time.monotonic()]))
        if client is not None and not client.flush():
            raise RuntimeError("background acks did not reach the daemon")
        cmd.send({"cpu_s": time.process_time() - cpu0})
    for c in clients.values():
        c.close()
    pull.close(0)
    done.close(0)
    ctx.term()


def producer_main(n_consumers: int, runtime_dir: str, sock_dir: str, threads: int, cmd: Any, mp_queues: list) -> None:
    import torch

    torch.set_num_threads(threads)
    ctx = zmq.Context()
    pushes = []
    for rank in range(n_consumers):
        s = ctx.socket(zmq.PUSH)
        s.sndhwm = 0
        s.bind(f"ipc://{sock_dir}/feat-{rank}.sock")
        pushes.append(s)
    done = ctx.socket(zmq.PULL)
    done.bind(f"ipc://{sock_dir}/done.sock")
    clients: dict[str, Any] = {}
    cmd.send("ready")
    while (job := cmd.recv()) is not None:
        payload = torch.randint(0, 255, (job.size,), dtype=torch.uint8).to(job.device)
        client = _client_for(clients, runtime_dir, job.mode)
        total = job.count + job.warmup
        # torch.multiprocessing shares a storage once; a new feature is a new storage, made before timing.
        fresh = [payload.clone() for _ in range(total)] if job.mode == "torch_mp" else []
        ring = _ring(ring_path(sock_dir), job.size * job.window, create=True) if job.mode == "shm_ring" else None
        sent_at: list[float] = []
        read_at: dict[int, list[float]] = {}
        held_at: dict[int, list[float]] = {}
        acked = 0  # features every consumer has finished

        def collect(block: bool) -> None:
            nonlocal acked
            while done.poll(None if block else 0):
                i, th, t1 = msgpack.unpackb(done.recv())
                held_at.setdefault(i, []).append(th)
                read_at.setdefault(i, []).append(t1)
                block = False
            while len(read_at.get(acked, ())) == n_consumers:
                acked += 1

        cpu0 = time.process_time()
        for i in range(total):
            if i == job.warmup:
                # Every consumer has read the warm-up: sessions open, arenas granted, pages faulted in.
                # The CPU columns start here, mmfeatd's once the parent has sampled it.
                while acked < i:
                    collect(block=True)
                cmd.send("warm")
                cmd.recv()
                cpu0 = time.process_time()  # all threads; the payload and torch_mp's fresh tensors are made already
            while i - acked >= job.window:
                collect(block=True)
            t0 = time.monotonic()
            if job.mode == "torch_mp":
                for q in mp_queues:
                    q.put((i, fresh[i]))
                fresh[i] = None
            elif job.mode == "floor":
                header = msgpack.packb(i)
                for s in pushes:
                    s.send_multipart([header, _FLOOR_MESSAGE])
            elif job.mode == "shm_ring":
                slot = i % job.window  # feature i - window is read by every consumer: i - acked < window
                host = payload.cpu()
                ctypes.memmove(ring.data_ptr() + slot * job.size, host.data_ptr(), job.size)
                header = msgpack.packb(i)
                for s in pushes:
                    s.send_multipart([header, b"%d" % slot])
            elif job.mode == "zmq_bytes":
                header = msgpack.packb(i)
                host = payload.cpu().numpy()  # the device-to-host copy a server pays without a GPU path
                for s in pushes:
                    s.send_multipart([header, host], copy=False)
            else:
                blob = client.put(payload, consumers=n_consumers).to_bytes()
                header = msgpack.packb(i)
                for s in pushes:
                    # copy=False as zmq_bytes sends: pyzmq copies what is under its copy threshold anyway
                    # (every pool descriptor), and shares an inline payload with the socket.
                    s.send_multipart([header, blob], copy=False)
            sent_at.append(t0)
            collect(block=False)
        while acked < total:
            collect(block=True)
        first = job.warmup
        latencies = [max(read_at[i]) - sent_at[i] for i in range(first, total)]
        first_held = [min(held_at[i]) - sent_at[i] for i in range(first, total)]
        elapsed = max(max(read_at[i]) for i in range(first, total)) - sent_at[first]
        if ring is not None:
            del ring
            os.unlink(ring_path(sock_dir))  # consumers keep their mapping until their next job
        fallbacks = dict(client.fallbacks) if client is not None else {}
        cmd.send({"latencies": latencies, "first_held": first_held, "elapsed": elapsed, "fallbacks": fallbacks,
                  "cpu_s": time.process_time() - cpu0})
    for c in clients.values():
        c.close()
    for s in (*pushes, done):
        s.close(0)
    ctx.term()
