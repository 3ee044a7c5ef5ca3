"""Requests in flight on a control connection (SPEC.md, section 2): within MAX_IN_FLIGHT the daemon drops
no reply however a peer reads, past it a peer costs the daemon a bounded queue, and the reference client
stays within it whatever it pipelines."""

from __future__ import annotations

import dataclasses
import threading

import msgpack
import pytest
import torch
import zmq

from mmfeat.protos import MAX_IN_FLIGHT, PROTOCOL_VERSION, DaemonUnavailableError

_READ_S = 5.0  # a reply not read by then was dropped: the daemon answers a ping in microseconds


def _ping(i: int) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": i})


@pytest.fixture
def dealer(daemon):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(f"ipc://{daemon.runtime_dir / 'mmfeatd.sock'}")
    yield s
    s.close()
    ctx.term()


def test_a_peer_with_the_limit_in_flight_gets_every_reply(daemon, dealer) -> None:
    """Bursts of MAX_IN_FLIGHT pipelined pings, read as they arrive. libzmq counts what a peer's pipe
    holds from reports sent every half a mark, so a few pings one at a time before each burst leave the
    daemon's count of its queue behind by a different amount each time, up to its worst."""
    lost, ids = 0, iter(range(1 << 30))
    for burst in range(20):
        for _ in range(burst * 29 % 64):
            dealer.send(_ping(next(ids)))
            assert dealer.poll(int(_READ_S * 1000)), "a ping alone went unanswered"
            dealer.recv()
        sent = [next(ids) for _ in range(MAX_IN_FLIGHT)]
        for i in sent:
            dealer.send(_ping(i))
        got = set()
        while len(got) < len(sent) and dealer.poll(int(_READ_S * 1000)):
            got.add(msgpack.unpackb(dealer.recv())["id"])
        lost += len(set(sent) - got)
        if len(got) < len(sent):
            break  # the rest of a burst that lost replies is not coming either
    assert lost == 0, f"{lost} replies lost in burst {burst} of {MAX_IN_FLIGHT} pipelined pings"
    assert daemon.stats()["counters"]["replies_dropped"] == 0


def test_a_peer_far_over_the_limit_loses_replies_counted_and_the_daemon_serves_on(daemon, dealer) -> None:
    dealer.sndhwm = 100_000
    n = 40 * MAX_IN_FLIGHT
    for i in range(n):
        dealer.send(_ping(i))
    s = daemon.wait_for(lambda s: s["counters"]["requests"] >= n, what="the flood of pings to be read")
    assert s["counters"]["replies_dropped"] > 0
    got = 0
    while dealer.poll(1000):
        dealer.recv()
        got += 1
    # Four times the limit queued in the daemon, and what the kernel's socket buffers held.
    assert got + daemon.stats()["counters"]["replies_dropped"] == n
    assert got < n
    with daemon.client() as c:
        assert c.ping()["ok"]


def test_the_client_keeps_its_pipelined_requests_within_the_limit(daemon) -> None:
    """Prefetch hints are the requests the client pipelines on the control socket (acks and publishes go
    in the lease table or on the fd channel). Each hint here fails (this daemon has no mesh), so each
    gets an error reply: unbounded, thousands of them would queue ahead of the calls' replies."""
    with daemon.client(inline_threshold=0) as c:
        remote = dataclasses.replace(c.put(torch.ones(256)), node="elsewhere")
        channel = c._channel
        worst, errors = [0], []

        go = threading.Event()  # the storm starts behind a ping, so that pings meet it however threads run

        def storm() -> None:
            go.wait(30)
            try:
                for _ in range(2000):
                    c.prefetch(remote)
                    with channel._lock:
                        worst[0] = max(worst[0], channel._in_flight.count())
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=storm) for _ in range(3)]
        for t in threads:
            t.start()
        pings = 0
        while any(t.is_alive() for t in threads):
            go.set()
            try:
                c.ping()
            except DaemonUnavailableError as exc:
                pytest.fail(f"a ping went unanswered among the hints: {exc}")
            pings += 1
        for t in threads:
            t.join()
        assert not errors, errors
        assert daemon.stats()["counters"]["replies_dropped"] == 0
        assert worst[0] <= MAX_IN_FLIGHT
        assert pings > 0
