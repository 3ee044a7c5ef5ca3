"""Clients for tests/test_pid_namespaces.py, each run as ``python -m tests.pidns_workers MODE RUNTIME_DIR`` in
namespaces of its own, as a pod without hostPID, hostIPC or hostNetwork runs: the runtime dir's socket files
are all it shares with the daemon. Each talks to the test over stdin and stdout, one JSON object a line,
and says which pid it has in its own namespace and which namespace that is."""

from __future__ import annotations

import gc
import json
import mmap
import os
import socket
import struct
import sys
import time
from typing import Any

import msgpack
import torch

from mmfeat.client import Client
from mmfeat.protos import PROTOCOL_VERSION
from mmfeat.protos.lease_table import PUBLISHED, STATE, state_word, table_bytes, word_offset

ELEMENTS = 1 << 18  # 1 MiB of float32: a pool feature, not an inline one


def tensor(seed: int) -> torch.Tensor:
    return torch.arange(ELEMENTS, dtype=torch.float32) + seed


def _say(**kw: Any) -> None:
    print(json.dumps({"pid": os.getpid(), "pidns": os.readlink("/proc/self/ns/pid"), **kw}), flush=True)


def _hear() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:  # the test is gone: nobody to answer
        sys.exit(3)
    return json.loads(line)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def put(runtime_dir: str) -> None:
    """Put a feature, then keep the session until told to close, as a server's producer does."""
    with Client(runtime_dir, inline_threshold=0, fallback="error") as c:
        desc = c.put(tensor(7), consumers=1)
        _say(desc=desc.to_bytes().hex())
        _hear()
    _say(closed=True)


def get(runtime_dir: str) -> None:
    """Read the feature the test hands over, check every byte, ack it, and count this process's fds
    before and after (a first client beforehand: ZeroMQ's context stays for the process's life)."""
    msg = _hear()
    with Client(runtime_dir) as warm:
        warm.request("ping")
    del warm
    gc.collect()
    before = _fds()
    with Client(runtime_dir) as c:
        got = c.get(bytes.fromhex(msg["desc"]))
        same = bool(torch.equal(got, tensor(msg["seed"])))
        freed = c.ack(bytes.fromhex(msg["desc"]), wait=True)["freed"]
    del got, c
    # The view held the pool's mapping; ZeroMQ closes a socket's fd on its I/O thread, a moment later.
    deadline = time.monotonic() + 10
    while (after := (gc.collect(), _fds())[1]) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    _say(same=same, freed=freed, fds_before=before, fds_after=after)


def hold_and_hang(runtime_dir: str) -> None:
    """Reserve leases and publish one feature, then wait to be killed."""
    c = Client(runtime_dir, inline_threshold=0, fallback="error")
    desc = c.put(tensor(11), consumers=1)
    for _ in range(int(os.environ.get("RESERVES", "5"))):
        c.request("reserve", session=c.session.token, nbytes=1 << 20, consumers=1)
    _say(desc=desc.to_bytes().hex())
    _hear()  # never answered: the test kills this process


def refused_words(runtime_dir: str) -> None:
    """A session opened as the client opens one (its hello names this process's own pid), whose slots then
    hold words the daemon refuses until it is cut; then wait to be killed."""
    c = Client(runtime_dir)
    hello = c.request("hello", name="refuses", pid=os.getpid())
    token, slots = hello["session"], hello["table_slots"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.path.join(runtime_dir, "mmfeatd.fds.sock"))
    sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "session": token}))
    _, fds, _, _ = socket.recv_fds(sock, 4096, 8)
    for fd in fds[:-1]:
        os.close(fd)
    table = mmap.mmap(fds[-1], table_bytes(slots), flags=mmap.MAP_SHARED)
    os.close(fds[-1])
    refs = [c.request("reserve", session=token, nbytes=4096, consumers=1)["lease"] for _ in range(20)]
    cut = False
    for rnd in range(1, 100):
        if c.stats()["counters"]["sessions_cut"]:  # each request sweeps the table once
            cut = True
            break
        for ref in refs:
            refused = state_word(ref["gen"] + rnd, PUBLISHED)
            struct.pack_into("<Q", table, word_offset(slots, ref["lease"], STATE), refused)
    _say(cut=cut)
    _hear()


if __name__ == "__main__":
    {"put": put, "get": get, "hold_and_hang": hold_and_hang, "refused_words": refused_words}[sys.argv[1]](sys.argv[2])
