"""Nothing waits forever: TTLs free leases (a reservation's range at its session's end), a dead producer's
RESERVED leases are reclaimed at once."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from . import workers
from .ttls import ttls


def test_reserve_ttl_keeps_an_unpublished_range_until_its_session_ends(daemon_factory) -> None:
    """Past reserve_ttl a reservation is counted expired, and its range stays its producer's (it may still
    be writing there) until its session ends."""
    d = daemon_factory("--pool-mb", "16", "--reserve-ttl", "0.3")
    with d.client() as c:
        session = c.session
        c.request("reserve", session=session.token, nbytes=4096, consumers=1)
        # Counted, not looked for among the live leases: a loaded machine's stats call can come after
        # the 0.3 s TTL.
        assert d.stats()["counters"]["reserves"] == 1
        s = d.wait_for(lambda s: s["counters"]["expired"] == 1, what="reserve_ttl expiry")
        assert s["expired_reserved"] == 1 and s["leases"]["RESERVED"] == 1
        assert s["pools"][0]["bytes"]["RESERVED"] == 4096
    s = d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the session's end to free it")
    assert s["leases"]["RESERVED"] == 0 and s["expired_reserved"] == 0 and s["counters"]["reclaimed_on_disconnect"] == 1


def test_ack_ttl_frees_published_and_spares_acked(daemon_factory) -> None:
    for ttl in ttls(3.0):
        d = daemon_factory("--pool-mb", "16", "--ack-ttl", str(ttl))
        with d.client(inline_threshold=0) as c:
            abandoned = c.put(torch.ones(10000), consumers=2)
            put_at = time.monotonic()
            done = c.put(torch.ones(10000), consumers=1)
            c.ack(done)  # a store into the lease table: made when this returns
            if time.monotonic() - put_at < ttl:  # else a busy machine paused this thread past ack_ttl
                # Features, not the pool: the producer's arena stays granted until it idles out.
                s = d.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="both features to end")
                assert s["counters"]["expired"] == 1 and s["counters"]["frees"] == 2
                assert abandoned.lease != done.lease or abandoned.gen != done.gen
                return
        assert d.stop() == 0  # again, with a longer ack_ttl
    pytest.fail(f"no ack came within an ack_ttl of {ttl} s")


def test_killed_producer_reserved_leases_freed_at_once(daemon, children) -> None:
    ctx = children
    ready = ctx.Queue()
    p = ctx.Process(target=workers.reserve_and_hang, args=(str(daemon.runtime_dir), 5, 1 << 20, ready))
    p.start()
    try:
        pid = ready.get(timeout=60)
        s = daemon.stats()
        assert s["pools"][0]["leases"]["RESERVED"] == 5 and s["clients"] == 1
        os.kill(pid, signal.SIGKILL)
        # reserve_ttl is 30 s by default: freeing within seconds proves the disconnect did it.
        s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=20, what="reclaim on disconnect")
        assert s["counters"]["reclaimed_on_disconnect"] == 5 and s["counters"]["expired"] == 0
        assert s["clients"] == 0
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()


def test_published_leases_survive_producer_exit(daemon) -> None:
    with daemon.client(inline_threshold=0) as producer:
        desc = producer.put(torch.arange(5000), consumers=1)
    # The producer closed its session; the feature is the consumers' now.
    with daemon.client() as consumer:
        assert torch.equal(consumer.get(desc), torch.arange(5000))
        assert consumer.ack(desc, wait=True)["freed"]
    assert daemon.pool()["used"] == 0


def test_producer_exiting_without_close_still_publishes(daemon, tmp_path) -> None:
    import subprocess
    import sys

    out = tmp_path / "desc.bin"
    code = (
        "import sys, torch\n"
        "from mmfeat.client import Client\n"
        "c = Client(sys.argv[1], inline_threshold=0)\n"
        "d = c.put(torch.arange(20000), consumers=1)\n"
        "open(sys.argv[2], 'wb').write(d.to_bytes())\n"
        # no close(): the interpreter exits with the publish possibly still queued
    )
    for _ in range(2):  # each round is a fresh interpreter that imports torch: 3 s here
        r = subprocess.run([sys.executable, "-c", code, str(daemon.runtime_dir), str(out)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        with daemon.client() as consumer:
            assert torch.equal(consumer.get(out.read_bytes()), torch.arange(20000))
            assert consumer.ack(out.read_bytes(), wait=True)["freed"]
    s = daemon.stats()
    assert s["counters"]["reclaimed_on_disconnect"] == 0 and s["counters"]["publishes"] == 2
    assert s["pools"][0]["used"] == 0
