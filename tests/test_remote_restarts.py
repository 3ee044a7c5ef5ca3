"""Acks relayed to an owner that restarted or froze: each one reaches the owner that issued its feature
and is applied there once, or is refused and counted; none is lost silently, and none is applied to
another epoch's feature. Real daemons as nodes; the restart case in network namespaces, where a
firewall rule in the owner's namespace holds the relaying node's connection back for as long as the
test needs, so that what it relays is queued before the owner has heard its hello."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from typing import Iterator

import pytest
import torch
import zmq

from mmfeat.daemon.config import Peer, Settings
from mmfeat.daemon.mesh.outbox import MeshOutbox, PeerCounters
from mmfeat.daemon.mesh.peers import MAX_EARLY, MAX_EARLY_BYTES, Mesh
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.mesh import MeshAck, decode_mesh, encode_mesh

from .cluster import Cluster, idle, meshed

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed: make setup installs mmfeat[mesh]")


@contextlib.contextmanager
def refused(cluster: Cluster, node: str) -> Iterator[None]:
    """Connections to ``node``'s mesh port are refused (a TCP reset, so the peer's DEALER keeps trying
    every 100 ms and connects as soon as this ends); what the node itself connects to is untouched."""
    assert cluster.netns is not None
    if shutil.which("iptables") is None:
        pytest.skip("iptables is not installed: the test cannot hold a connection back")
    rule = ["INPUT", "-p", "tcp", "--dport", str(cluster.ports[node]), "-j", "REJECT", "--reject-with", "tcp-reset"]
    prefix = cluster.netns.prefix(cluster.netns.addrs.index(cluster.hosts[node]))
    subprocess.run([*prefix, "iptables", "-I", *rule], check=True, capture_output=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run([*prefix, "iptables", "-D", *rule], check=True, capture_output=True, timeout=30)


@pytest.mark.parametrize("cluster", ["netns"], indirect=True)
def test_acks_relayed_before_the_restarted_owner_heard_the_relayer_are_applied_once(cluster) -> None:
    """b queues, for a restarted a that has not heard b's hello yet: an ack of the old epoch's feature,
    and acks of the new epoch's (more than one batch of them, without waiting). Once b's connection
    gets through, the new epoch's acks are applied and the old one is refused, though the new epoch's
    first feature has the old one's slot and generation. An old epoch's ack made once b knows of the
    restart is not relayed at all: b counts it dropped."""
    a, b = meshed(cluster)
    consumer = b.client()
    with a.client(inline_threshold=0, fallback="error") as producer:
        old, late = (producer.put(torch.arange(64) + k, consumers=1) for k in range(2))
        epoch = a.stats()["epoch"]
    assert torch.equal(consumer.get(old), torch.arange(64)) and torch.equal(consumer.get(late), torch.arange(64) + 1)
    with refused(cluster, "a"):
        cluster.stop("a", signal.SIGKILL)
        consumer.ack(old)  # b does not know yet: relayed to the old a, and queued
        b.wait_for(lambda s: s["mesh"]["peers"][0]["acks_relayed"] == 1, timeout=20, what="b to relay the ack")
        a = cluster.start("a", ["b"], "--pool-mb", "160")
        new_epoch = a.stats()["epoch"]
        assert new_epoch != epoch
        b.wait_for(lambda s: s["mesh"]["peers"][0]["epoch"] == new_epoch, timeout=20, what="b to see a's new epoch")
        consumer.ack(late)  # b knows a restarted: not relayed, counted, and its copy goes
        b.wait_for(lambda s: s["mesh"]["peers"][0]["acks_dropped"] == 1 and s["mesh"]["copies"] == 0, timeout=20,
                   what="b to drop the ack of the old epoch's feature")
        with a.client(inline_threshold=0, fallback="error") as producer:
            first = producer.put(torch.arange(64) + 1, consumers=2)
            many = [producer.put(torch.full((16,), k), consumers=1) for k in range(300)]
        slot = [(d.lease_ref()["lease"], d.lease_ref()["gen"]) for d in (first, old)]
        assert slot[0] == slot[1]  # the old epoch's ack names the very slot and generation of the new feature
        assert torch.equal(consumer.get(first), torch.arange(64) + 1)
        for k, desc in enumerate(many):
            assert torch.equal(consumer.get(desc), torch.full((16,), k))
        consumer.ack(first)
        for desc in many:
            consumer.ack(desc)
        b.wait_for(lambda s: s["mesh"]["peers"][0]["acks_relayed"] == 302, timeout=20, what="b to relay the acks")
        s = a.stats()
        assert s["mesh"]["peers"][0]["node"] is None and s["counters"]["acks"] == 0  # nothing got through yet
    s = a.wait_for(lambda s: s["pools"][0]["leases"]["PUBLISHED"] == 1, timeout=20, what="a to apply b's acks")
    assert s["mesh"]["peers"][0]["acks_received"] == 301 and s["counters"]["acks"] == 301
    assert s["counters"]["over_acks"] == 0 and s["counters"]["stale"] == 1  # the old epoch's ack, refused
    b.wait_for(lambda s: s["mesh"]["copies"] == 1, timeout=20, what="b to drop the copies a ended")
    answer = consumer.ack(first, wait=True)  # the first feature's second consumer: the old ack took nothing
    assert answer["freed"] and answer["remaining"] == 0
    consumer.close()
    idle(a, "a to free the first feature")
    idle(b, "b to drop its copy")


def test_an_ack_relayed_to_a_frozen_owner_is_applied_when_it_resumes_and_one_made_while_it_is_missing_is_counted(
        cluster) -> None:
    """Frozen past the time b marks it missing: b's ack that waited in a's socket meanwhile is applied
    when a resumes (a counts no misses of its own while stopped: it sent no probes). An ack made while
    b holds a missing is not relayed: b counts it dropped, and frees its copy."""
    a, b = meshed(cluster)
    with a.client(inline_threshold=0, fallback="error") as producer:
        relayed, dropped = (producer.put(torch.arange(64) + k, consumers=1) for k in range(2))
    consumer = b.client()
    try:
        for desc in (relayed, dropped):
            consumer.get(desc)
        a.proc.send_signal(signal.SIGSTOP)
        try:
            consumer.ack(relayed)
            b.wait_for(lambda s: s["mesh"]["peers"][0]["acks_relayed"] == 1, timeout=20, what="b to relay the ack")
            b.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "missing", timeout=20, what="b to mark a missing")
            consumer.ack(dropped)
            s = b.wait_for(lambda s: s["mesh"]["peers"][0]["acks_dropped"] == 1, timeout=20,
                           what="b to count the ack it could not relay")
            assert s["mesh"]["copies"] == 0  # no owner will say they ended; both were acked here
        finally:
            a.proc.send_signal(signal.SIGCONT)
        s = a.wait_for(lambda s: s["counters"]["acks"] == 1, timeout=20, what="a to apply the relayed ack")
        assert s["pools"][0]["leases"]["PUBLISHED"] == 1 and s["mesh"]["peers"][0]["acks_received"] == 1
        b.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "up" and s["mesh"]["peers"][0]["node"] == "a",
                   timeout=20, what="a up again at b")
        # The dropped ack is not replayed (a consumer that must know acks with wait=True): acked again now.
        assert consumer.ack(dropped, wait=True)["freed"]
    finally:
        consumer.close()
    idle(a, "a to free both features")
    idle(b, "b to hold nothing")


def test_acks_still_batched_for_a_peer_that_restarts_are_answered_and_counted(tmp_path) -> None:
    """An ack waits up to ACK_BATCH_S in its peer's box; if the peer goes down or restarts meanwhile,
    the ack was for the epoch that is gone: a waiting client hears why at once (not at its timeout) and
    the ack is counted dropped. A real Mesh, with keys and a listener; the peer need not exist."""
    cluster = Cluster(tmp_path)
    for n in ("a", "b"):
        cluster.node(n)
    settings = Settings(node_id="b", listen=cluster.endpoint("b"), mesh_secret_file=tmp_path / "keys-b" / "mesh.secret",
                        peers=[Peer(endpoint=cluster.endpoint("a"), public_key=cluster.keys["a"])])
    ctx = zmq.Context()
    mesh = Mesh(ctx, settings, lambda: {"node": "b", "epoch": 1, "pools": []}, lambda fd: False)
    try:
        counters: dict[str, PeerCounters] = {}
        outbox = MeshOutbox(mesh, 1, lambda key: counters.setdefault(key, PeerCounters()))
        lease = {"pool": 0, "epoch": 7, "lease": 1, "gen": 1, "token": b"t" * 16, "offset": 0, "nbytes": 64}
        answers: list = []
        outbox.ack(cluster.keys["a"], MeshAck(lease=lease, count=3), answers.append, 0.0)
        outbox.ack(cluster.keys["a"], MeshAck(lease=lease, count=2), None, 0.0)
        gone = MmfeatError(ErrorCode.PEER_UNAVAILABLE, "node a restarted")
        outbox.drop_peer(cluster.keys["a"], gone)
        assert answers == [gone] and counters[cluster.keys["a"]].acks_dropped == 5
        outbox.flush(1.0)  # nothing left to send
        assert counters[cluster.keys["a"]].acks_relayed == 0
    finally:
        mesh.close()
        ctx.term()


def _heartbeat(peer: zmq.Socket) -> bool:
    """A ping from the peer, as a real one sends every probe_interval_s, however long this test takes
    between two of its steps: a peer that leaves miss_limit probes unanswered is missing, and once it is
    forgotten, what it sent before its hello is dropped. A ping is held for no hello and counted nowhere
    but in the peer's messages."""
    peer.send(encode_mesh("ping", {"seq": 1}))
    return True


def test_requests_before_a_peers_hello_are_held_to_a_bound_then_answered_in_order(cluster) -> None:
    """What an authenticated peer sends before its hello is held, at most MAX_EARLY requests (the rest
    counted bad), the peer is asked for its hello at once, and once it comes every held request is
    handled in order: the one real ack among forged ones frees the feature."""
    cluster.node("a")
    cluster.node("b")
    a = cluster.start("a", ["b"])  # b is never started: its key is used from here
    with a.client(inline_threshold=0, fallback="error") as producer:
        lease = producer.put(torch.arange(64), consumers=1).lease_ref()
    ctx = zmq.Context()
    peer = cluster.impersonate(ctx, "b", "a")
    try:
        forged = {**lease, "token": b"\0" * 16}
        peer.send(encode_mesh("acks", {"batch": 0, "acks": [{"lease": lease, "count": 1}]}))
        for k in range(1, MAX_EARLY + 50):
            peer.send(encode_mesh("acks", {"batch": k, "acks": [{"lease": forged, "count": 1}]}))
        assert peer.poll(60_000)
        op, body = decode_mesh(peer.recv())
        assert op == "pong" and body.need_hello  # asked for the hello without waiting for a ping
        s = a.wait_for(lambda s: _heartbeat(peer) and s["mesh"]["bad_messages"] == 50,
                       what="a to refuse what is past the bound")
        assert s["counters"]["acks"] == 0 and s["pools"][0]["leases"]["PUBLISHED"] == 1
        peer.send(encode_mesh("hello", {"node": "b", "epoch": 5, "pools": []}))
        answers = []
        while len(answers) < MAX_EARLY and peer.poll(60_000):
            op, body = decode_mesh(peer.recv())
            if op == "acked":
                answers.append(body)
        assert [r.batch for r in answers] == list(range(MAX_EARLY))
        assert answers[0].results[0].freed and all(r.results[0].code for r in answers[1:])
        s = a.stats()
        assert s["counters"]["acks"] == 1 and s["pools"][0]["leases"]["PUBLISHED"] == 0
        assert s["mesh"]["peers"][0]["acks_received"] == 1 and s["mesh"]["bad_messages"] == 50
    finally:
        peer.close()
        ctx.term()


def test_requests_held_before_a_hello_are_bounded_in_bytes_too(cluster) -> None:
    cluster.node("a")
    cluster.node("b")
    a = cluster.start("a", ["b"])
    lease = {"pool": 0, "epoch": 1, "lease": 1, "gen": 1, "token": b"\0" * 16, "offset": 0, "nbytes": 64}
    frame = encode_mesh("acks", {"batch": 1, "acks": [{"lease": lease, "count": 1}] * 256})
    fit = MAX_EARLY_BYTES // len(frame)
    assert fit < MAX_EARLY
    ctx = zmq.Context()
    peer = cluster.impersonate(ctx, "b", "a")
    try:
        for _ in range(fit + 20):
            peer.send(frame)
        a.wait_for(lambda s: _heartbeat(peer) and s["mesh"]["bad_messages"] == 20,
                   what="a to refuse what is past the bytes")
        peer.send(encode_mesh("hello", {"node": "b", "epoch": 5, "pools": []}))
        s = a.wait_for(lambda s: s["counters"]["stale"] == 256 * fit, what="a to handle what it held")
        assert s["mesh"]["bad_messages"] == 20 and a.proc.poll() is None
    finally:
        peer.close()
        ctx.term()
