"""Holds over pulled copies (``Client.hold_remote``, remote_get with ``hold``): what a vLLM consumer's
scheduler takes for its ranks. Real daemons meshed on 127.0.0.1, producers and consumers in clients of
their own: a held copy outlives its owner's end until its readers acked, every client on a node shares
one pull, and a copy only ever held is a cache the pool may evict, while one read in place is not."""

from __future__ import annotations

import pytest
import torch

from mmfeat.client import Namespace
from mmfeat.client.link.channel import ControlChannel
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.paths import control_endpoint

from .cluster import idle, meshed

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed: make setup installs mmfeat[mesh]")

NS = Namespace(framework="test", version="1", model="m", dtype="f32")


def test_a_held_copy_outlives_its_owners_end_until_its_readers_acked(cluster) -> None:
    a, b = meshed(cluster)
    x = torch.randn(1 << 18)
    with a.client(inline_threshold=0, fallback="error") as producer, b.client() as c1, b.client() as c2:
        desc = producer.put(x, key=NS.key("one"), retain_ttl=300)
        held = c1.hold_remote(desc, count=2)
        again = c2.hold_remote(desc, count=1)  # another instance on b: the same copy, no second pull
        assert held.node == again.node == "b" and (held.lease, held.gen) != (again.lease, again.gen)
        s = b.stats()
        peer = s["mesh"]["peers"][0]
        assert s["mesh"]["copies"] == 1 and s["holds"] == 2 and peer["pulls"] == 1 and peer["shared_gets"] == 1
        producer.evict(NS.key("one"))  # the owner's feature ends: a tells b, whose copy its holds keep
        b.wait_for(lambda s: s["mesh"]["copies"] == 0, timeout=20, what="b to hear that a's feature ended")
        assert b.pool()["used"] > 0
        assert torch.equal(c1.get(held, copy=True), x) and torch.equal(c2.get(again, copy=True), x)
        c1.ack(held, count=2)
        c1.flush()
        assert b.pool()["used"] > 0  # the other hold still reads it
        c2.ack(again)
        c2.flush()
    idle(b, "b to free the copy once its last hold ended")


def test_a_hold_needs_a_session_that_holds_it(cluster) -> None:
    a, b = meshed(cluster)
    with a.client(inline_threshold=0, fallback="error") as producer:
        desc = producer.put(torch.randn(1 << 16), consumers=1)
        channel = ControlChannel(control_endpoint(b.runtime_dir), 10.0)
        try:
            with pytest.raises(MmfeatError) as exc:
                channel.call("remote_get", node="a", lease=desc.lease_ref(), wait_s=5, hold=2)
            assert exc.value.code is ErrorCode.BAD_REQUEST
        finally:
            channel.close()
        producer.ack(desc, wait=True)


def test_a_copy_only_held_is_evicted_under_pressure_and_one_read_in_place_is_not(cluster) -> None:
    a, b = meshed(cluster, pool_mb=16)
    x1, x2 = torch.randn(6 << 18), torch.randn(6 << 18)  # 6 MiB each
    with a.client(inline_threshold=0, fallback="error") as producer, b.client() as reader, \
            b.client(inline_threshold=0, fallback="error") as local:
        d1 = producer.put(x1, key=NS.key("held"), retain_ttl=300)
        d2 = producer.put(x2, key=NS.key("plain"), retain_ttl=300)
        reader.ack(reader.hold_remote(d1))  # read by its hold's readers, then held by nothing
        reader.flush()
        view = reader.get(d2)  # read in place, holding nothing
        assert b.stats()["mesh"]["copies"] == 2
        # 12 of b's 16 MiB are copies: a 5 MiB put needs one of them gone, and only the held one may go.
        local.ack(local.put(torch.randn(5 << 18), consumers=1))
        s = b.stats()
        assert s["mesh"]["copies"] == 1 and s["counters"]["evictions"] == 1, s["mesh"]
        assert torch.equal(view, x2)
        del view
        reader.ack(d2)
