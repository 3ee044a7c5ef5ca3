"""Zero-copy production: reserve a tensor in the pool, fill it in place, publish it."""

from __future__ import annotations

import gc

import pytest
import torch

from mmfeat.client import Client
from mmfeat.client.gpu import dlpack
from mmfeat.protos import DaemonUnavailableError, ErrorCode, MmfeatError

from . import reservation_workers, workers
from .conftest import assert_fds_settle, fan_out, fd_count

BIG = (40, 1 << 20)  # 40 MiB of uint8: more than half of a 128 MiB pool's arena, so a reserved lease


def _no_features(s: dict) -> bool:
    return s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}


def test_filled_in_place_and_read_right_by_two_consumer_processes(daemon_factory, children) -> None:
    """A producer process reserves every dtype and size, from a few bytes (arenas) to 40 MiB (reserved
    leases) and one reserve_many, writes each with an out= kernel and publishes: what each descriptor
    names is the memory it wrote (no copy), two consumer processes read every byte right, and after
    their acks the pool and the daemon's fds are as before."""
    d = daemon_factory("--pool-mb", "256")
    daemon_fds = fd_count(d.pid)
    q_prod, q_cons, results = children.Queue(), [children.Queue(), children.Queue()], children.Queue()
    consumers = [children.Process(target=workers.consume, args=(str(d.runtime_dir), q, results, copy))
                 for q, copy in zip(q_cons, (False, True))]
    producer = children.Process(target=reservation_workers.produce_reserved,
                                args=(str(d.runtime_dir), 2, q_prod, results))
    for p in (*consumers, producer):
        p.start()
    fan_out(q_prod, q_cons)
    out = sorted(results.get(timeout=90) for _ in range(3))
    for p in (*consumers, producer):
        p.join(30)
        assert p.exitcode == 0, f"{p.name} exited {p.exitcode}"
    kind, in_place, sent = out[-1]
    assert kind == "producer" and in_place == sent, out
    assert out[:2] == [("ok", sent), ("ok", sent)], out
    s = d.wait_for(_no_features, what="every feature acked")
    assert s["counters"]["reserves"] > 0 and s["counters"]["arena_publishes"] > 0, "both paths were used"
    assert s["counters"]["reserves"] + s["counters"]["arena_publishes"] == sent == s["counters"]["frees"]
    assert s["counters"]["fallbacks"] == {} and s["pools"][0]["used"] == 0
    assert_fds_settle(d.pid, daemon_fds)


def test_a_dropped_reservation_gives_its_space_back(daemon) -> None:
    """Dropping a reserved tensor unpublished gives its arena space back at once (the next reserve
    gets the same range) and releases its reserved lease; a view still alive keeps the reservation.
    No DLPack header outlives the tensors over it."""
    headers = dlpack.live_capsules()
    with daemon.client(inline_threshold=0, fallback="error") as c:
        warm = c.reserve((1024,), torch.float32)  # the arena is granted here
        c.discard(warm)
        t = c.reserve((4096,), torch.float32)
        first = t.data_ptr()
        view = t[10:20]
        del t
        gc.collect()
        again = c.reserve((4096,), torch.float32)
        assert again.data_ptr() != first, "a view of the dropped tensor was alive: its range was handed out"
        del view, again
        gc.collect()
        assert c.reserve((4096,), torch.float32).data_ptr() == first, "the dropped range did not come back"
        big = c.reserve(BIG, torch.uint8)
        assert daemon.stats()["leases"]["RESERVED"] == 1
        del big
        # Well within reserve_ttl (30 s): the drop released the lease.
        daemon.wait_for(lambda s: s["leases"]["RESERVED"] == 0, timeout=10, what="the dropped lease's release")
    s = daemon.wait_for(_no_features, what="nothing left")
    assert s["pools"][0]["used"] == 0 and s["counters"]["expired"] == 0
    del warm  # discarded, still referenced here
    gc.collect()
    assert dlpack.live_capsules() == headers


def test_publish_and_discard_refuse_what_is_not_an_open_reservation(daemon) -> None:
    """Publishing twice, a tensor reserve did not return (a plain one, a view, another client's, part
    of a reserve_many list), or one discarded or closed, raises a typed error and sends nothing."""
    with daemon.client(inline_threshold=0) as c, daemon.client(inline_threshold=0) as other:
        t = c.reserve((256,), torch.int32)
        t.fill_(3)
        desc = c.publish(t)
        with pytest.raises(MmfeatError) as info:
            c.publish(t)
        assert info.value.code is ErrorCode.BAD_STATE and "published already" in info.value.message
        foreign = [torch.zeros(256, dtype=torch.int32), c.reserve((8, 8), torch.float32)[0],
                   other.reserve((4,), torch.int8)]
        for bad in foreign:
            with pytest.raises(MmfeatError) as info:
                c.publish(bad)
            assert info.value.code is ErrorCode.BAD_REQUEST, info.value
        pair = c.reserve_many([((2,), torch.int64), ((3,), torch.int64)])
        for bad in (pair[0], pair[::-1], pair[:1]):
            with pytest.raises(MmfeatError) as info:
                c.publish(bad)
            assert info.value.code is ErrorCode.BAD_REQUEST
        c.discard(pair)
        with pytest.raises(MmfeatError) as info:
            c.publish(pair)
        assert info.value.code is ErrorCode.BAD_STATE and "discarded" in info.value.message
        open_one = c.reserve(BIG, torch.uint8)
        assert torch.equal(other.get(desc), torch.full((256,), 3, dtype=torch.int32))
        other.ack(desc)
    with pytest.raises(MmfeatError) as info:
        c.publish(open_one)
    assert info.value.code is ErrorCode.BAD_STATE and "closed" in info.value.message
    with pytest.raises(MmfeatError) as info:
        c.reserve((4,), torch.int8)
    assert info.value.code is ErrorCode.BAD_STATE
    s = daemon.wait_for(_no_features, what="close to give back the open reservation")
    assert s["pools"][0]["used"] == 0 and s["counters"]["publishes"] == 1  # the first one only


def test_bad_arguments_are_refused(daemon) -> None:
    with daemon.client() as c:
        for shape, dtype, kw, exc in [((-1,), torch.float32, {}, ValueError), ((2.5,), torch.float32, {}, ValueError),
                                      ("x", torch.float32, {}, ValueError), ((4,), "float32", {}, TypeError),
                                      ((4,), torch.quint8, {}, TypeError),
                                      ((4,), torch.float32, {"consumers": 0}, ValueError),
                                      ((4,), torch.float32, {"device": "meta"}, ValueError)]:
            with pytest.raises(exc):
                c.reserve(shape, dtype, **kw)
        with pytest.raises(ValueError):
            c.reserve_many([])


def test_no_daemon_gives_an_ordinary_tensor_and_an_inline_descriptor(tmp_path) -> None:
    """Daemon unreachable: reserve returns an ordinary tensor and publish sends it inline, so the
    producer's code does not change; fallback='error' raises at reserve instead."""
    with Client(tmp_path, timeout=0.5, inline_threshold=0) as c:
        t = c.reserve((100, 100), torch.float32)
        torch.add(torch.ones(100, 100), 1, out=t)
        desc = c.publish(t)
        assert desc.is_inline and c.fallbacks["unreachable"] == 1
        assert torch.equal(Client(tmp_path).get(desc), torch.full((100, 100), 2.0))
        with pytest.raises(MmfeatError) as info:
            c.publish(t)
        assert info.value.code is ErrorCode.BAD_STATE
    with Client(tmp_path, timeout=0.5, inline_threshold=0, fallback="error") as c:
        with pytest.raises(DaemonUnavailableError):
            c.reserve((100,), torch.float32)


def test_a_daemon_gone_between_reserve_and_publish_sends_the_bytes_inline(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "128")
    with d.client(inline_threshold=0, timeout=1.0) as c:
        small, big = c.reserve((64, 64), torch.float64), c.reserve(BIG, torch.uint8)
        small.fill_(1.5)
        big.fill_(9)
        assert d.stop() == 0
        expected = (torch.full((64, 64), 1.5, dtype=torch.float64), torch.full(BIG, 9, dtype=torch.uint8))
        for t, expect in zip((small, big), expected):
            desc = c.publish(t)
            assert desc.is_inline and torch.equal(Client(d.runtime_dir, timeout=1.0).get(desc), expect)


def test_a_full_pool_or_a_small_feature_gives_an_ordinary_tensor(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "1")
    with d.client(inline_threshold=0) as c, d.client(inline_threshold=4096) as small:
        t = c.reserve((2, 1 << 20), torch.uint8)  # larger than the pool
        t.fill_(4)
        desc = c.publish(t)
        assert desc.is_inline and c.fallbacks["too_large"] == 1 and torch.equal(c.get(desc), t)
        s = small.reserve((10,), torch.int16)
        s.copy_(torch.arange(10))
        assert small.publish(s).is_inline and small.fallbacks["below_threshold"] == 1
    assert d.stats()["counters"]["reserves"] == 0


def test_publish_after_reserve_ttl_raises_instead_of_naming_reused_memory(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "128", "--reserve-ttl", "0.5")
    with d.client(inline_threshold=0) as c:
        t = c.reserve(BIG, torch.uint8)
        d.wait_for(lambda s: s["counters"]["expired"] == 1, what="the reservation to expire")
        with pytest.raises(MmfeatError) as info:
            c.publish(t)
        assert info.value.code is ErrorCode.STALE and "reserve_ttl" in info.value.message
    assert d.pool()["used"] == 0


def test_a_feature_neither_the_pool_nor_inline_can_take_is_refused_at_reserve(daemon_factory) -> None:
    """Larger than the pool and over inline_max: its publish could only raise TOO_LARGE, so reserve
    raises it, instead of allocating (or failing to allocate) an ordinary tensor of that size."""
    d = daemon_factory("--pool-mb", "1")
    with d.client(inline_threshold=0, inline_max=1 << 20) as c:
        for shape in [(2, 1 << 20), (1 << 42,)]:  # 2 MiB, and 4 TiB: more than this host could allocate
            with pytest.raises(MmfeatError) as info:
                c.reserve(shape, torch.uint8)
            assert info.value.code is ErrorCode.TOO_LARGE and "inline_max" in info.value.message
        t = c.reserve((1 << 19,), torch.uint8)  # within the pool: reserved there as before
        assert d.pool()["used"] >= 1 << 19
        c.discard(t)



def test_a_shape_whose_bytes_overflow_is_a_value_error(daemon) -> None:
    with daemon.client(inline_threshold=0) as c:
        for layout in [[((1 << 62, 4), torch.float32)], [((1 << 63,), torch.uint8)],
                       [((1 << 40, 1 << 40), torch.int64)], [((1 << 61,), torch.int64), ((1 << 61,), torch.int64)],
                       [((0, 1 << 63), torch.uint8)], [((0, 1 << 40, 1 << 40), torch.uint8)]]:
            with pytest.raises(ValueError, match="bytes|strides"):
                c.reserve_many(layout)
    assert daemon.stats()["counters"]["reserves"] == 0
