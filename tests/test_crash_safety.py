"""Processes that die at the worst moment: a descriptor that left its producer stays readable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

_PRODUCER = """
import os, signal, sys, torch
from mmfeat.client import Client
runtime_dir, rounds, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for r in range(rounds):
    pid = os.fork()
    if pid == 0:
        c = Client(runtime_dir, inline_threshold=0, fallback="error")
        d = c.put(torch.full((64 * 1024,), float(r)), consumers=1)
        os.write(out, len(d.to_bytes()).to_bytes(4, "little") + d.to_bytes())
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush, no atexit: dead the moment put returned
    os.waitpid(pid, 0)
os.close(out)
"""


def test_a_producer_killed_right_after_put_leaves_a_readable_feature(daemon) -> None:
    rounds = 25
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, str(daemon.runtime_dir), str(rounds), str(w)],
                            pass_fds=(w,))
    os.close(w)
    blobs = []
    with os.fdopen(r, "rb") as pipe:
        while header := pipe.read(4):
            blobs.append(pipe.read(int.from_bytes(header, "little")))
    assert proc.wait(120) == 0 and len(blobs) == rounds
    with daemon.client(inline_threshold=0) as other, daemon.client() as consumer:
        # Another producer takes whatever the daemon frees: if a dead producer's lease had been
        # reclaimed, these would overwrite it.
        fillers = [other.put(torch.full((64 * 1024,), -1.0)) for _ in range(rounds)]
        for k, blob in enumerate(blobs):
            assert torch.equal(consumer.get(blob), torch.full((64 * 1024,), float(k))), f"round {k} reads other bytes"
            assert consumer.ack(blob, wait=True)["freed"]
        for f in fillers:
            other.ack(f)
    s = daemon.wait_for(lambda s: s["clients"] == 0, what="the killed producers' sessions to end")
    assert s["counters"]["reclaimed_on_disconnect"] == 0 and s["counters"]["publishes"] == 2 * rounds
    assert s["pools"][0]["used"] == 0


def test_a_producer_killed_while_it_writes_leaves_no_lease(daemon) -> None:
    code = (
        "import os, signal, sys\n"
        "from mmfeat.client import Client\n"
        "c = Client(sys.argv[1])\n"
        "s = c.session\n"
        "c.request('reserve', session=s.token, nbytes=1 << 20, consumers=1)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    for _ in range(3):
        assert subprocess.run([sys.executable, "-c", code, str(daemon.runtime_dir)],
                              timeout=300).returncode == -signal.SIGKILL
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=20, what="reclaim on disconnect")
    assert s["counters"]["reclaimed_on_disconnect"] == 3


def test_an_empty_datagram_on_the_fd_channel_is_not_an_end_of_session(daemon) -> None:
    with daemon.client(inline_threshold=0) as c:
        d = c.put(torch.ones(1000))
        session = c.session
        session.fd.send_frame(b"")  # zero bytes read like EOF; the session must survive it
        assert session.fd.sync(5.0)
        d2 = c.put(torch.ones(1000))
        assert c.session is session
        c.ack(d)
        c.ack(d2)
    assert daemon.stats()["counters"]["bad_requests"] >= 1


def test_a_background_ack_survives_the_consumer_dying_right_after(daemon) -> None:
    code = (
        "import os, signal, sys\n"
        "from mmfeat.client import Client\n"
        "c = Client(sys.argv[1])\n"
        "c.get(bytes.fromhex(sys.argv[2]))\n"
        "c.ack(bytes.fromhex(sys.argv[2]), wait=False)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    with daemon.client(inline_threshold=0) as producer:
        descs = [producer.put(torch.ones(10_000), consumers=1) for _ in range(3)]  # a torch import each
    for d in descs:
        r = subprocess.run([sys.executable, "-c", code, str(daemon.runtime_dir), d.to_bytes().hex()], timeout=300)
        assert r.returncode == -signal.SIGKILL
    # ack_ttl is 300 s: an empty pool within seconds proves every ack was applied.
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=30, what="the dead consumers' acks")
    assert s["counters"]["acks"] == 3 and s["counters"]["expired"] == 0
