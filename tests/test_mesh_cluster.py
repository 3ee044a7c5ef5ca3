"""Three nodes as three machines: a network namespace each on one bridge, each its own daemon, finding
the others through a DNS name that each namespace's own /etc/hosts resolves (as a headless Service's
records would), with the peers' keys in a directory per node. A node joins, one is killed and
restarted, a key is revoked: each time pulls go where they should, over the bridge, and nothing is read
from a dead incarnation. Every step waits for what stats says, never for a time."""

from __future__ import annotations

import signal

import pytest
import torch

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.testing import free_tcp_port

from .netns import publish

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed: make setup installs mmfeat[mesh]")

NAME = "mmfeat-mesh"  # the headless Service's name, in each namespace's hosts file


def _state(s: dict, address: str) -> str:
    return next((p["state"] for p in s["mesh"]["peers"] if p["listed_as"] == address), "unlisted")


def _states(cluster, *nodes: str, state: str = "up"):
    return lambda s: all(_state(s, cluster.hosts[n]) == state for n in nodes)


def _read(consumer, desc) -> torch.Tensor:
    return consumer.get(desc, copy=True)


def _refused(consumer, desc) -> ErrorCode:
    with pytest.raises(MmfeatError) as info:
        consumer.get(desc)
    return info.value.code


@pytest.mark.parametrize("cluster", ["netns3"], indirect=True)
def test_three_namespaces_meet_by_dns_and_pulls_follow_a_join_a_restart_and_a_revoked_key(cluster) -> None:
    netns = cluster.netns
    port = free_tcp_port()  # the Service's port: the same in every namespace
    for n in "abc":
        cluster.node(n, port)
    addr = cluster.hosts
    mesh = {"peers_from": "dns", "peers_dns": f"{NAME}:{port}", "peers_refresh_s": 0.2,
            "probe_interval_s": 0.5, "miss_limit": 6, "forget_after_s": 120.0}

    def start(n: str):
        return cluster.start(n, [], "--pool-mb", "64", mesh={**mesh, "keys_dir": cluster.keyring(n)})

    # a and b: the name lists both, each trusts the other.
    for i in range(3):
        publish(netns, i, NAME, [addr["a"], addr["b"]])
    cluster.trust("a", "b")
    cluster.trust("b", "a")
    a, b = start("a"), start("b")
    a.wait_for(_states(cluster, "b"), timeout=30, what="b up at a")
    b.wait_for(_states(cluster, "a"), timeout=30, what="a up at b")
    assert a.stats()["mesh"]["quorum"] == {"members": 2, "reachable": 2, "ok": True}

    # c joins: its record and key appear at a and b (probed from then on, before c even runs).
    for n in "ab":
        cluster.trust(n, "c")
    cluster.trust("c", "a")
    cluster.trust("c", "b")
    for i in range(3):
        publish(netns, i, NAME, [addr["c"]])
    a.wait_for(_states(cluster, "c", state="joining"), timeout=30, what="c listed at a, not running yet")
    c = start("c")
    for d, others in ((a, "bc"), (b, "ac"), (c, "ab")):
        d.wait_for(_states(cluster, *others), timeout=30, what=f"{others} up")
    with a.client() as on_a, b.client() as on_b, c.client(inline_threshold=0, fallback="error") as on_c:
        x = torch.randn(1 << 18)
        old = on_c.put(x, consumers=2)
        assert torch.equal(_read(on_a, old), x) and torch.equal(_read(on_b, old), x)
        cluster.check_data_plane("a", x.numel() * 4)

        # c dies: a get of its feature is refused while it is missing, and after its restart the feature
        # of the dead incarnation is STALE, never its bytes; a feature of the new one is pulled.
        cluster.stop("c", signal.SIGKILL)
        a.wait_for(_states(cluster, "c", state="missing"), timeout=30, what="c missing at a")
        assert _refused(on_a, old) is ErrorCode.PEER_UNAVAILABLE
        for consumer in (on_a, on_b):
            consumer.ack(old)  # cannot reach its owner: frees the copy here all the same
    c = start("c")
    epoch = c.stats()["epoch"]
    for d in (a, b):
        d.wait_for(lambda s: any(p["epoch"] == epoch and p["state"] == "up" for p in s["mesh"]["peers"]), timeout=30,
                   what="c's new incarnation up")
    with a.client() as on_a, b.client() as on_b, c.client(inline_threshold=0, fallback="error") as on_c:
        assert _refused(on_a, old) is ErrorCode.STALE and _refused(on_b, old) is ErrorCode.STALE
        y = torch.randn(1 << 18)
        new = on_c.put(y, consumers=2)
        assert torch.equal(_read(on_a, new), y) and torch.equal(_read(on_b, new), y)
        for consumer in (on_a, on_b):
            assert consumer.ack(new, wait=True)["remaining"] in (0, 1)

        # b's key is revoked at a: a drops b and ends its connections; b's features are out of a's reach
        # and a's of b's once b sees a gone, while a and c go on as before.
        with b.client(inline_threshold=0, fallback="error") as producer:
            of_b = producer.put(torch.ones(1 << 16), consumers=1)
        with a.client(inline_threshold=0, fallback="error") as producer:
            of_a = producer.put(torch.full((1 << 16,), 2.0), consumers=2)
        cluster.revoke("a", "b")
        s = a.wait_for(_states(cluster, "b", state="gone"), timeout=30, what="b gone at a")
        assert s["mesh"]["connections_ended"] >= 1
        # Still in the name, without a key now: a member nobody reaches, listed as such.
        assert [p["state"] for p in s["mesh"]["peers"] if p["listed_as"] == addr["b"]] == ["gone", "no_key"]
        assert s["mesh"]["quorum"] == {"members": 3, "reachable": 2, "ok": True}
        assert _refused(on_a, of_b) is ErrorCode.PEER_UNAVAILABLE
        b.wait_for(lambda s: _state(s, addr["a"]) in ("missing", "auth_failed"), timeout=30, what="a cut off at b")
        assert _refused(on_b, of_a) is ErrorCode.PEER_UNAVAILABLE
        assert torch.equal(_read(on_c, of_a), torch.full((1 << 16,), 2.0))
        assert on_c.ack(of_a, wait=True)["remaining"] == 1
        assert b.stats()["mesh"]["quorum"] == {"members": 3, "reachable": 2, "ok": True}  # b still reaches c
        on_a.ack(of_a)  # the consumer that b no longer is
        on_b.ack(of_b)
