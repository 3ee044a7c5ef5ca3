"""Acknowledgement edge cases: each gets its documented reply, nothing is freed twice, others untouched."""

from __future__ import annotations

import os

import pytest
import torch

from mmfeat.protos import PROTOCOL_VERSION, Descriptor, ErrorCode, MmfeatError


def _put(c, consumers: int, n: int = 4096) -> Descriptor:
    return c.put(torch.arange(n, dtype=torch.float32), consumers=consumers)


def _code(fn) -> ErrorCode:
    with pytest.raises(MmfeatError) as info:
        fn()
    return info.value.code


def test_group_ack_and_over_ack(daemon) -> None:
    with daemon.client(inline_threshold=0) as c:
        bystander = _put(c, consumers=2)
        d = _put(c, consumers=4)
        assert c.ack(d, count=2, wait=True) == {"remaining": 2, "freed": False, "over_acked": 0}
        # An encoder owner acking for a group larger than what is left: clamped, counted, freed once.
        assert c.ack(d, count=5, wait=True) == {"remaining": 0, "freed": True, "over_acked": 3}
        s = daemon.stats()
        assert s["counters"]["over_acks"] == 3 and s["counters"]["frees"] == 1
        assert s["pools"][0]["leases"]["PUBLISHED"] == 1  # the bystander
        assert torch.equal(c.get(bystander), torch.arange(4096, dtype=torch.float32))
        assert c.ack(bystander, count=2, wait=True)["freed"]
    assert daemon.pool()["used"] == 0


def test_double_ack_is_not_found_and_frees_nothing_twice(daemon) -> None:
    with daemon.client(inline_threshold=0) as c:
        d = _put(c, consumers=1)
        other = _put(c, consumers=1)
        assert c.ack(d, wait=True)["freed"]
        assert _code(lambda: c.ack(d, wait=True)) is ErrorCode.NOT_FOUND
        s = daemon.stats()
        assert s["counters"]["frees"] == 1 and s["pools"][0]["leases"]["PUBLISHED"] == 1
        # Reuse d's slot: the old descriptor is now STALE, and cannot touch the new lease.
        reused = _put(c, consumers=1)
        assert (reused.lease, reused.gen) == (d.lease, d.gen + 1)
        assert _code(lambda: c.ack(d, wait=True)) is ErrorCode.STALE
        assert _code(lambda: c.get(d)) is ErrorCode.STALE
        assert c.ack(reused, wait=True)["freed"] and c.ack(other, wait=True)["freed"]
    assert daemon.pool()["used"] == 0


def test_wrong_token_and_forged_fields_are_forbidden(daemon) -> None:
    from dataclasses import replace

    with daemon.client(inline_threshold=0) as c:
        d = _put(c, consumers=1)
        for forged in (
            replace(d, token=bytes(16)),
            replace(d, offset=d.offset + 256),
            replace(d, nbytes=d.nbytes * 2),
        ):
            assert _code(lambda: c.ack(forged, wait=True)) is ErrorCode.FORBIDDEN
            assert _code(lambda: c.release(forged)) is ErrorCode.FORBIDDEN
        assert _code(lambda: c.ack(replace(d, lease=10_000), wait=True)) is ErrorCode.NOT_FOUND
        assert _code(lambda: c.ack(replace(d, pool=7), wait=True)) is ErrorCode.NOT_FOUND
        assert _code(lambda: c.ack(replace(d, epoch=d.epoch + 1), wait=True)) is ErrorCode.STALE
        assert daemon.stats()["counters"]["forbidden"] == 6
        assert c.ack(d, wait=True)["freed"]  # the real one still works
    assert daemon.pool()["used"] == 0


def test_release_and_publish_states(daemon) -> None:
    with daemon.client(inline_threshold=0) as c:
        d = _put(c, consumers=3)
        token = c.session.token
        assert _code(lambda: c.request("publish", session=token, lease=d.lease_ref())) is ErrorCode.BAD_STATE
        c.release(d)
        assert _code(lambda: c.ack(d, wait=True)) is ErrorCode.NOT_FOUND
    s = daemon.stats()
    assert s["pools"][0]["used"] == 0 and s["counters"]["releases"] == 1


def test_ack_that_overtakes_the_pipelined_publish(daemon) -> None:
    """Producers pipeline publish, so a consumer's ack may arrive first: it counts, and the lease is
    freed when the publish lands, not before."""
    with daemon.client() as c:
        session = c.session
        ref = c.request("reserve", session=session.token, nbytes=1000, consumers=2)["lease"]
        assert c.request("lookup", lease=ref)["state"] == "RESERVED"
        assert c.request("ack", lease=ref, count=1)["freed"] is False
        reply = c.request("ack", lease=ref, count=2)
        assert (reply["remaining"], reply["freed"], reply["over_acked"]) == (0, False, 1)
        assert daemon.pool()["leases"] == {"RESERVED": 1, "PUBLISHED": 0}
        c.request("publish", session=session.token, lease=ref)
        assert _code(lambda: c.request("lookup", lease=ref)) is ErrorCode.NOT_FOUND
    s = daemon.stats()
    assert s["pools"][0]["used"] == 0 and s["counters"]["frees"] == 1 and s["counters"]["over_acks"] == 1


def test_only_the_producer_may_release_or_publish(daemon) -> None:
    with daemon.client(inline_threshold=0) as producer, daemon.client() as consumer:
        d = _put(producer, consumers=2)
        with pytest.raises(MmfeatError) as info:
            consumer.release(d)
        assert info.value.code is ErrorCode.FORBIDDEN and "only the session that reserved" in info.value.message
        token = consumer.session.token
        assert _code(lambda: consumer.request("publish", session=token, lease=d.lease_ref())) is ErrorCode.FORBIDDEN
        assert torch.equal(consumer.get(d), torch.arange(4096, dtype=torch.float32))  # untouched
        assert consumer.ack(d, count=2, wait=True)["freed"]
        assert daemon.stats()["counters"]["releases"] == 0
    assert daemon.pool()["used"] == 0


def test_background_acks_reach_the_daemon(daemon, caplog) -> None:
    import logging

    with daemon.client(inline_threshold=0) as c:
        descs = [_put(c, consumers=2) for _ in range(50)]
        for d in descs:
            assert c.ack(d, count=2, wait=False) is None
        assert c.flush(5.0)
        assert daemon.pool()["bytes"] == {"RESERVED": 0, "PUBLISHED": 0}
        # A feature this client did not ack, that ended: the quiet ack fails on the wire, and that
        # failure is counted and logged, never raised on some later call.
        gone = _put(c, consumers=1)
        c.release(gone)
        with caplog.at_level(logging.WARNING, logger="mmfeat.client"):
            assert c.ack(gone, wait=False) is None
            assert c.flush(5.0)
        assert any("NOT_FOUND" in r.message for r in caplog.records), caplog.records
        assert c.async_failures == {"ack NOT_FOUND": 1}
    assert daemon.stats()["counters"]["frees"] == 51  # the release frees too


def test_ack_of_expired_lease_says_so(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "16", "--ack-ttl", "0.3")
    with d.client(inline_threshold=0) as c:
        desc = _put(c, consumers=2)
        s = d.wait_for(lambda s: s["counters"]["expired"] == 1, what="ack_ttl expiry")
        assert s["pools"][0]["bytes"] == {"RESERVED": 0, "PUBLISHED": 0}
        with pytest.raises(MmfeatError) as info:
            c.ack(desc, wait=True)
        assert info.value.code is ErrorCode.NOT_FOUND and "ack_ttl" in info.value.message
        with pytest.raises(MmfeatError):
            c.get(desc)  # verify refuses to hand out a view of freed memory


def test_get_of_a_live_lease_needs_no_round_trip(daemon) -> None:
    """The lease table answers for live leases: a get works while the daemon is frozen."""
    import signal

    # A get that asked the frozen daemon would time out and raise; 2 s, as the ack after the thaw must
    # not time out on a loaded machine either.
    with daemon.client(inline_threshold=0) as producer, daemon.client(timeout=2.0) as consumer:
        desc = producer.put(torch.arange(4096, dtype=torch.float32), consumers=1)
        consumer.get(desc)  # connects (and maps) while the daemon runs
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            assert torch.equal(consumer.get(desc), torch.arange(4096, dtype=torch.float32))
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        consumer.ack(desc, wait=True)
        # Freed: now the table sends get to the daemon, which says why.
        with pytest.raises(MmfeatError) as info:
            consumer.get(desc)
        assert info.value.code is ErrorCode.NOT_FOUND and "all acks received" in info.value.message


def test_clients_cannot_resize_the_lease_table(daemon) -> None:
    """Clients map the table writable (they publish and ack there) but its size is sealed: nobody can
    shrink it under the daemon's mapping (which would kill the daemon with SIGBUS) or grow it."""
    import socket as pysocket

    import msgpack

    with daemon.client() as c:
        session = c.session
        s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_SEQPACKET)
        s.connect(str(daemon.runtime_dir / "mmfeatd.fds.sock"))
        # A second session, to get our own copy of the table fd.
        hello = c.request("hello")
        s.send(msgpack.packb({"v": PROTOCOL_VERSION, "session": hello["session"]}))
        data, fds, _, _ = pysocket.recv_fds(s, 4096, 8)
        try:
            assert msgpack.unpackb(data)["table"] is True
            table_fd = fds[-1]
            size = os.fstat(table_fd).st_size
            for new_size in (0, size // 2, size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(table_fd, new_size)
        finally:
            for fd in fds:
                os.close(fd)
            s.close()
        assert session.table.slots == 65536 and session.table.writable
    # The session's end reaches the daemon as its fd channel's EOF, after close() returns.
    daemon.wait_for(lambda s: s["clients"] == 0, what="both sessions to end")


def test_second_ack_of_an_ended_feature_fails_at_its_call(daemon) -> None:
    """A repeat of an ack this client made, once the feature has ended, raises at that call: nothing is
    sent, so no failure surfaces later on an unrelated call."""
    with daemon.client(inline_threshold=0) as c:
        one, two, waited = _put(c, consumers=1), _put(c, consumers=2), _put(c, consumers=1)
        c.ack(one)  # the table ack that completes the count
        assert _code(lambda: c.ack(one)) is ErrorCode.NOT_FOUND
        c.ack(two)
        c.ack(two)  # the same process may stand for both consumers: still live until this one
        with pytest.raises(MmfeatError) as info:
            c.ack(two)
        assert info.value.code is ErrorCode.NOT_FOUND and "already acked it 2 time(s)" in info.value.message
        assert c.ack(waited, wait=True)["freed"]
        assert _code(lambda: c.ack(waited)) is ErrorCode.NOT_FOUND
        assert c.flush(5.0)
        assert c.async_failures == {}
        s = daemon.stats()
        assert s["counters"]["not_found"] == 0 and s["counters"]["over_acks"] == 0 and s["counters"]["frees"] == 3
    assert daemon.pool()["used"] == 0


def test_pipelined_failures_are_counted_per_kind_and_logged_once(daemon, caplog) -> None:
    import logging

    with daemon.client(inline_threshold=0) as producer, daemon.client() as consumer:
        gone = [_put(producer, consumers=1) for _ in range(5)]
        for d in gone:
            producer.release(d)
        with caplog.at_level(logging.WARNING, logger="mmfeat.client"):
            for d in gone:  # ended before this consumer acked: only the daemon can say so, later
                assert consumer.ack(d) is None
            session = consumer.session
            for _ in range(3):
                session.fd.send_frame(b"\xc1")
            assert consumer.flush(5.0)
            assert consumer.async_failures == {"ack NOT_FOUND": 5, "request BAD_REQUEST": 3}
            firsts = [r.getMessage() for r in caplog.records if "pipelined" in r.getMessage()]
            assert len(firsts) == 2, firsts
            consumer.close()
        summary = [r.getMessage() for r in caplog.records if "by kind" in r.getMessage()]
        assert summary == ["pipelined requests that failed, by kind: ack NOT_FOUND x5, request BAD_REQUEST x3"]


def test_a_finaliser_that_runs_while_its_client_opens_a_session_does_not_wait_for_it(daemon) -> None:
    """A garbage collection inside _connect (a thread reopening the session, say after a daemon restart,
    holds the connect lock with no session set) can run a loads() value's finaliser in that same thread.
    Its ack must not wait for the lock that thread holds: it goes to the background thread, which acks
    once the session is back. The lock held and the session unset here stand in for that moment."""
    import subprocess
    import sys

    code = """
import sys, torch
from mmfeat.client import Client
with Client(sys.argv[1], inline_threshold=0) as p, Client(sys.argv[1]) as c:
    desc = p.put(torch.ones(1000))
    c.get(desc)
    with c._connect_lock:
        session, c._session = c._session, None
        c._ack_in_finalizer(desc)  # waited for ever on the lock this thread holds
        c._session = session
    assert c.flush(10.0)
    print(c.stats()["counters"]["acks"])
"""
    out = subprocess.run([sys.executable, "-c", code, str(daemon.runtime_dir)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["1"], out.stderr[-2000:]
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the acked feature to be freed")
