"""A producer refuses, before anything is placed, every feature whose descriptor a consumer's parse
would refuse: the limits are protos/tensor_spec.py's, read by both sides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmfeat.client import ErrorCode, MmfeatError, Namespace, dumps, loads
from mmfeat.protos import tensor_spec
from mmfeat.protos.messages import MAX_KEPT_DESCRIPTOR_BYTES

DIMS = tensor_spec._MAX_DIMS
TENSORS = tensor_spec.MAX_TENSORS
BIG = tensor_spec._MAX_INT  # shapes, strides and offsets
_ODD = torch.float8_e4m3fnuz  # a dtype no descriptor names


def _meta(*shape: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _over_the_limits() -> dict[str, tuple[type, str, object]]:
    """Every limit the parse enforces on what a producer makes, on every path a feature can take: the
    one-frame put (a dense host tensor into the session's arena), the general one (a non-contiguous
    tensor), inline (under the threshold), a lease of its own (a large feature), put_many, reserve,
    reserve_many and dumps. By name: (the error, what it says, the call)."""
    deep, many = [2] * (DIMS + 1), TENSORS + 1
    dims = (ValueError, f"at most {DIMS}, and every consumer refuses more; reshape it")
    count = (ValueError, f"1 to {TENSORS} tensors.*several features|at most {TENSORS}.*split it over several dumps")
    past = (ValueError, "past (the )?2\\^62.*(send smaller tensors|several features)")
    dtype = (TypeError, "cannot carry dtype")
    return {
        "dims, one-frame put": (*dims, lambda c: c.put(torch.zeros(deep, dtype=torch.uint8))),
        "dims, general put": (*dims, lambda c: c.put(torch.zeros(deep, dtype=torch.uint8).transpose(0, 1))),
        "dims, inline put": (*dims, lambda c: c.put(torch.zeros([1] * (DIMS + 1)))),
        "dims, own-lease put": (*dims, lambda c: c.put(torch.zeros([48] + deep))),
        "dims, put_many": (*dims, lambda c: c.put_many([torch.ones(1000), torch.zeros(deep)])),
        "dims, reserve": (*dims, lambda c: c.reserve(deep, torch.float32)),
        "dims, reserve_many": (*dims, lambda c: c.reserve_many([((1000,), torch.float32), (deep, torch.float32)])),
        "dims, dumps": (*dims, lambda c: dumps({"x": torch.zeros(deep)}, client=c)),
        "count, put_many in the pool": (*count, lambda c: c.put_many([torch.ones(256)] * many)),
        "count, put_many inline": (*count, lambda c: c.put_many([torch.ones(0)] * many)),
        "count, reserve_many": (*count, lambda c: c.reserve_many([((256,), torch.float32)] * many)),
        "count, dumps": (*count, lambda c: dumps([torch.ones(256) for _ in range(many)], client=c)),
        "a dimension past 2^62, put": (*past, lambda c: c.put(_meta(BIG + 1))),
        "a stride past 2^62, put": (*past, lambda c: c.put(_meta(1, 2, BIG // 2 + 1))),
        "a stride past 2^62, reserve": (*past, lambda c: c.reserve((1, 2, BIG // 2 + 1), torch.bool)),
        "an offset past 2^62, put_many": (*past, lambda c: c.put_many([_meta(BIG // 8 + 1, dtype=torch.float64),
                                                                        torch.ones(1)])),
        "dtype, one-frame put": (*dtype, lambda c: c.put(torch.zeros(65536, dtype=_ODD))),
        "dtype, general put": (*dtype, lambda c: c.put(torch.zeros(256, 256, dtype=_ODD).t())),
        "dtype, inline put": (*dtype, lambda c: c.put(torch.zeros(3, dtype=_ODD))),
        "dtype, put_many": (*dtype, lambda c: c.put_many([torch.ones(10), torch.zeros(3, dtype=_ODD)])),
        "dtype, reserve": (*dtype, lambda c: c.reserve((65536,), _ODD)),
        "dtype, dumps": (*dtype, lambda c: dumps({"x": torch.zeros(65536, dtype=_ODD)}, client=c)),
    }


def _books(daemon, c) -> tuple:
    """What a refused feature must leave as it was: the pool's use, the leases, the daemon's reserves
    and arena grants, this client's inline fallbacks, and its arenas' placements."""
    s = daemon.stats()
    arenas = [a for pool in c.session.arenas._arenas.values() for a in pool]
    placing = [a for a in arenas if a.writing()]
    return (s["pools"][0]["used"], s["leases"], s["counters"]["reserves"], s["pools"][0]["arenas"]["count"],
            dict(c.fallbacks), len(arenas), placing)


def test_every_limit_a_consumer_enforces_is_enforced_by_the_producer_on_every_path(daemon) -> None:
    """put_many of 1,100 tensors, put of a 17-dimension tensor and dumps of 1,100 tensors returned
    descriptors every consumer refused, even for ack, so their space stayed pinned until ack_ttl. Each
    such feature is now refused with what to do, before any pool space is taken or inline bytes built."""
    with daemon.client(inline_threshold=1024, fallback="error") as c, daemon.client(readonly=True) as consumer:
        consumer.ack(c.put(torch.zeros(100_000)))  # the session's arena, pool mapping and descriptor head
        consumer.flush()
        daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the first feature to end")
        before = _books(daemon, c)
        for name, (error, says, call) in _over_the_limits().items():
            with pytest.raises(error, match=says):
                call(c)
            assert _books(daemon, c) == before, f"{name}: the refused feature took pool space or went inline"


def test_a_feature_at_the_limits_is_read_by_a_consumer(daemon) -> None:
    """The limits refuse nothing a consumer reads: 1,024 tensors, 16 dimensions, through put_many,
    put, reserve and dumps, each read back from its bytes."""
    widest = [torch.full((64,), float(k)) for k in range(TENSORS)]
    deep = torch.arange(1 << DIMS, dtype=torch.float32).reshape([2] * DIMS)
    with daemon.client(inline_threshold=1024, fallback="error") as c, daemon.client(readonly=True) as consumer:
        blob = c.put_many(widest).to_bytes()
        assert all(torch.equal(a, b) for a, b in zip(consumer.get(blob), widest, strict=True))
        consumer.ack(blob)
        for sent in (deep, deep.transpose(0, 3)):  # the one-frame path and the general one
            blob = c.put(sent).to_bytes()
            assert torch.equal(consumer.get(blob), sent)
            consumer.ack(blob)
        reserved = c.reserve([2] * DIMS, torch.float32)
        reserved.copy_(deep)
        blob = c.publish(reserved).to_bytes()
        assert torch.equal(consumer.get(blob), deep)
        consumer.ack(blob)
        with loads(dumps(widest, client=c), client=consumer) as back:
            assert all(torch.equal(a, b) for a, b in zip(back, widest, strict=True))
        consumer.flush()
    daemon.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="the features to end")


def test_spec_states_the_limits_the_parser_enforces() -> None:
    spec = (Path(__file__).parent.parent / "protos" / "SPEC.md").read_text()
    section = spec.split("## 8. Descriptor", 1)[1].split("\n## 9.", 1)[0]
    assert f"1 to {TENSORS} tensors" in section and f"more than {DIMS} dimensions" in section
    assert BIG == 1 << 62 and "2^62" in section


def test_a_keyed_feature_whose_descriptor_the_daemon_cannot_keep_is_refused_before_anything_is_placed(daemon) -> None:
    """A keyed put_many of 150 tensors was reserved, written, then refused at its publish (the daemon keeps
    a key's descriptor of at most MAX_KEPT_DESCRIPTOR_BYTES), and its lease stayed RESERVED until
    reserve_ttl, every time. Such a feature is now refused before anything is reserved; the same tensors
    without a key (nothing kept) and a keyed feature under the cap go into the pool."""
    ns = Namespace(framework="test", version="1", model="limits", dtype="float32")
    wide = [torch.full((256,), float(k)) for k in range(150)]
    layout = [((256,), torch.float32)] * 150
    cap = (MmfeatError, f"over the {MAX_KEPT_DESCRIPTOR_BYTES} B.*fewer tensors per keyed feature.*without a key")
    consumers = (ValueError, "consumers must be an int between 1 and")
    refused = {
        "put_many, keyed": (*cap, lambda c, k: c.put_many(wide, key=k)),
        "put_many, keyed and retained": (*cap, lambda c, k: c.put_many(wide, key=k, retain_ttl=300.0)),
        "reserve_many, keyed": (*cap, lambda c, k: c.reserve_many(layout, key=k)),
        "reserve_many, keyed and retained": (*cap, lambda c, k: c.reserve_many(layout, key=k, retain_ttl=300.0)),
        "put, keyed, no consumer": (*consumers, lambda c, k: c.put(torch.ones(100_000), key=k, consumers=0)),
        "put, keyed, a bool of consumers": (*consumers, lambda c, k: c.put(torch.ones(100_000), key=k, consumers=True)),
    }
    with daemon.client(inline_threshold=1024, fallback="error") as c, daemon.client(readonly=True) as consumer:
        consumer.ack(c.put(torch.zeros(100_000)))  # the session's arena, pool mapping and descriptor head
        consumer.flush()
        daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the first feature to end")
        before = _books(daemon, c)
        for name, (error, says, call) in refused.items():
            key = ns.key(name.replace(" ", "-"))
            with pytest.raises(error, match=says) as raised:
                call(c, key)
            if error is MmfeatError:
                assert raised.value.code is ErrorCode.BAD_REQUEST
            assert _books(daemon, c) == before, f"{name}: the refused feature took pool space or a lease"
            assert not consumer.has(key)
        # Without a key nothing is kept: the same tensors are one retained feature in the pool.
        retained = c.put_many(wide, retain_ttl=300.0)
        assert not retained.is_inline
        assert all(torch.equal(a, b) for a, b in zip(consumer.get(retained, copy=True), wide, strict=True))
        c.release(retained)
        # Under the cap a keyed feature is kept and found.
        key = ns.key("under-the-cap")
        kept = c.put_many(wide[:64], key=key, retain_ttl=300.0)
        assert consumer.lookup(key) == kept
        assert c.evict(key)
    daemon.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="the features to end")


def test_spec_states_the_kept_descriptor_cap() -> None:
    spec = (Path(__file__).parent.parent / "protos" / "SPEC.md").read_text()
    assert f"1 to {MAX_KEPT_DESCRIPTOR_BYTES} bytes" in spec.split("### publish", 1)[1].split("### ack", 1)[0]
    keys = spec.split("### Keys and lifetimes", 1)[1].split("### lookup_key", 1)[0]
    assert f"fit those {MAX_KEPT_DESCRIPTOR_BYTES} bytes (`MAX_KEPT_DESCRIPTOR_BYTES`" in keys
    assert "before it reserves anything" in keys
