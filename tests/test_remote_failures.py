"""Features across nodes when something fails or attacks: an unlisted daemon, a frozen, dead or
restarted owner, a dead consumer node, a hostile listed peer. Real daemons on 127.0.0.1 as nodes."""

from __future__ import annotations

import signal
import time

import pytest
import torch
import zmq

from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError, PeerUnavailableError
from mmfeat.protos.mesh import decode_mesh, encode_mesh

from .cluster import idle, meshed
from .conftest import anon_bytes, fd_count
from .ttls import ttls

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed: make setup installs mmfeat[mesh]")


def test_an_unlisted_daemon_can_neither_pull_nor_ack(cluster) -> None:
    a, b = meshed(cluster)
    cluster.node("c")
    c = cluster.start("c", ["a"])  # c lists a, but a does not list c: CURVE refuses c at a's door
    a.wait_for(lambda s: s["mesh"]["refused"] > 0, timeout=20, what="a to refuse c")
    with a.client(inline_threshold=0, fallback="error") as producer, c.client(timeout=2) as stranger:
        desc = producer.put(torch.arange(4096), consumers=1)
        # One condition, one error: the get and the waiting ack raise the same type with the same code (a
        # DaemonUnavailableError too, as the remedy is the same).
        with pytest.raises(PeerUnavailableError, match="not a peer that is up") as on_get:
            stranger.get(desc)
        with pytest.raises(PeerUnavailableError, match="not a peer that is up") as on_ack:
            stranger.ack(desc, wait=True)
        assert on_get.value.code is on_ack.value.code is ErrorCode.PEER_UNAVAILABLE
        assert isinstance(on_get.value, DaemonUnavailableError) and str(on_get.value).startswith("PEER_UNAVAILABLE: ")
        assert a.pool()["leases"]["PUBLISHED"] == 1  # untouched
        with b.client() as consumer:
            assert torch.equal(consumer.get(desc), torch.arange(4096))
            consumer.ack(desc)
    idle(a, "a to free the feature b acked")


@pytest.mark.parametrize("cluster", ["host", "netns"], indirect=True)
def test_a_frozen_or_dead_owner_fails_gets_in_time_and_a_restarted_one_is_stale(cluster) -> None:
    """As netns: the owner in a network namespace of its own, its pulls over TCP across a veth, where a
    frozen peer leaves a TCP connection open rather than a process that cross-memory attach finds."""
    a, b = meshed(cluster)
    if cluster.netns is not None:
        # A pull while a is well, so that the frozen one below finds UCX connected over TCP and fails
        # in the READ itself. (Through cross-memory attach, once connected, b reads a stopped process's
        # pool and table as they are, and that get succeeds: only the first contact needs a running.)
        with a.client(inline_threshold=0, fallback="error") as producer, b.client() as consumer:
            served = producer.put(torch.arange(1 << 20), consumers=1)
            assert torch.equal(consumer.get(served), torch.arange(1 << 20))
            assert consumer.ack(served, wait=True)["freed"]
        idle(b, "b to drop the copy of a's first feature")
    with a.client(inline_threshold=0, fallback="error") as producer:
        frozen = producer.put(torch.randn(1 << 20), consumers=1)
        old = producer.put(torch.randn(1000), consumers=1)
    with b.client(timeout=3) as consumer:
        a.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailableError):
                consumer.get(frozen)
            # Bounded by the client's 3 s timeout, not a hang; the margin is for a loaded machine (make test runs a
            # worker more than there are cores).
            assert time.monotonic() - t0 < 6
        finally:
            a.proc.send_signal(signal.SIGCONT)
        cluster.stop("a", signal.SIGKILL)
        with pytest.raises(DaemonUnavailableError):
            consumer.get(old)  # a's daemon is gone; b marks it down within seconds, answers at once
        a = cluster.start("a", ["b"], "--pool-mb", "256")
        b.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "up"
                   and s["mesh"]["peers"][0]["epoch"] == a.stats()["epoch"],
                   timeout=20, what="a's new epoch")
        with pytest.raises(MmfeatError) as stale:
            consumer.get(old)
        assert stale.value.code is ErrorCode.STALE
    idle(b, "b to release the ranges of the failed pulls")
    cluster.check_data_plane("b", 8 << 20 if cluster.netns is not None else 0)


def test_when_the_consumers_node_dies_the_owner_frees_by_ack_ttl(cluster) -> None:
    for k, ttl in enumerate(ttls(3.0)):
        a, b = meshed(cluster, "--ack-ttl", str(ttl), nodes=(f"a{k}", f"b{k}"))
        with a.client(inline_threshold=0, fallback="error") as producer, b.client() as consumer:
            consumer.connect()
            put_at = time.monotonic()
            desc = producer.put(torch.randn(1 << 18), consumers=1)
            try:
                consumer.get(desc)
            except MmfeatError as exc:
                # The owner ended it before the pull: a busy machine took ack_ttl to get here.
                if exc.code is not ErrorCode.STALE or time.monotonic() - put_at < ttl:
                    raise
                ran_out = True
            else:
                ran_out = False
                cluster.stop(f"b{k}", signal.SIGKILL)
                s = idle(a, "a to free b's share by ack_ttl")
        if not ran_out:
            assert s["counters"]["expired"] == 1 and s["counters"]["acks"] == 0
            return
        cluster.stop(f"a{k}")  # again, with a longer ack_ttl
        cluster.stop(f"b{k}")
    pytest.fail(f"no pull came within an ack_ttl of {ttl} s")


def test_copies_of_a_dead_owners_features_go_once_the_consumers_here_acked(cluster) -> None:
    """No owner will say the features ended: the consumer's node frees each copy as soon as its consumers
    there are done with it (the ack_ttl here is the default 300 s), whether the ack was relayed or not."""
    a, b = meshed(cluster)
    with a.client(inline_threshold=0, fallback="error") as producer, b.client(timeout=3) as consumer:
        early, late = (producer.put(torch.randn(1 << 18), consumers=1) for _ in range(2))
        consumer.get(early)
        consumer.get(late)
        assert b.stats()["mesh"]["copies"] == 2
        cluster.stop("a", signal.SIGKILL)
        consumer.ack(early)  # before b knows: the relay may be queued for a peer that never answers
        b.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "missing", timeout=20, what="a missing")
        s = b.wait_for(lambda s: s["mesh"]["copies"] == 1, timeout=20, what="the acked copy freed")
        assert s["pools"][0]["leases"]["PUBLISHED"] == 1  # the other one is still read here
        with pytest.raises(PeerUnavailableError):
            consumer.ack(late, wait=True)  # cannot be relayed, and frees the copy all the same
        s = idle(b, "b to free the copies of a dead owner's features")
    assert s["counters"]["expired"] == 0 and s["mesh"]["copies"] == 0


def test_hostile_feature_messages_from_an_authenticated_peer_leave_the_owner_consistent(cluster) -> None:
    a, b = meshed(cluster)
    with a.client(inline_threshold=0, fallback="error") as producer:
        desc = producer.put(torch.arange(1 << 16), consumers=1)
    lease = desc.lease_ref()
    ctx = zmq.Context()
    evil = cluster.impersonate(ctx, "b", "a")
    epoch = a.stats()["epoch"]
    evil.send(encode_mesh("hello", {"node": "b", "epoch": 5, "pools": []}))
    base_mem, base_fds = anon_bytes(a.pid), fd_count(a.pid)
    forged = [
        {**lease, "token": b"\0" * 16}, {**lease, "gen": lease["gen"] + 1}, {**lease, "nbytes": lease["nbytes"] + 256},
        {**lease, "pool": 9}, {**lease, "lease": 1 << 40}, {**lease, "epoch": epoch + 1},
    ]
    for k in range(200):
        bad = forged[k % len(forged)]
        evil.send(encode_mesh("check", {"req": k, "lease": bad}))
        evil.send(encode_mesh("acks", {"batch": k, "acks": [{"lease": bad, "count": 4096}] * 8}))
        evil.send(encode_mesh("ended", {"epoch": epoch, "leases": [[k, k]] * 4}))
        evil.send(encode_mesh("pulled", {"leases": [bad] * 4}))
        evil.send(encode_mesh("acked", {"batch": k, "results": []}))  # a reply, sent as a request
    # A ping last: a answers in order, so its pong comes after every answer a gives, however long a busy
    # machine pauses a meanwhile.
    evil.send(encode_mesh("ping", {"seq": 7777}))
    answers = []
    while evil.poll(60_000):
        frame = evil.recv()
        op, body = decode_mesh(frame)
        if op == "pong" and body.seq == 7777:
            break
        answers.append(frame)
    assert len(answers) >= 300  # a check and an acks answer each, while the HWM allows
    s = a.stats()
    assert a.proc.poll() is None and s["pools"][0]["leases"]["PUBLISHED"] == 1  # no forged ack took effect
    assert s["counters"]["acks"] == 0 and s["mesh"]["bad_messages"] >= 200
    assert anon_bytes(a.pid) - base_mem < 16 << 20 and fd_count(a.pid) <= base_fds + 2
    evil.close()
    ctx.term()
    with b.client() as consumer:  # the real b still reads and acks
        assert torch.equal(consumer.get(desc), torch.arange(1 << 16))
        assert consumer.ack(desc, wait=True)["freed"]
