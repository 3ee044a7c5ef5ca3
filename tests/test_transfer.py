"""A producer process hands real tensors to two consumer processes through a real daemon's pool."""

from __future__ import annotations


import pytest
import torch

from mmfeat.client import Client
from mmfeat.protos import ErrorCode, MmfeatError

from . import workers
from .conftest import assert_fds_settle, fan_out, fd_count


def _run(ctx, runtime_dir, copies: tuple[bool, bool]) -> list:
    q_prod = ctx.Queue()
    q_cons = [ctx.Queue() for _ in copies]
    results = ctx.Queue()
    consumers = [
        ctx.Process(target=workers.consume, args=(str(runtime_dir), q, results, copy))
        for q, copy in zip(q_cons, copies)
    ]
    producer = ctx.Process(target=workers.produce, args=(str(runtime_dir), len(copies), q_prod))
    for p in (*consumers, producer):
        p.start()
    fan_out(q_prod, q_cons)  # the producer's descriptors to every consumer, as a server's scheduler would
    out = [results.get(timeout=90) for _ in consumers]
    for p in (*consumers, producer):
        p.join(30)
        assert p.exitcode == 0, f"{p.name} exited {p.exitcode}"
    return out


def test_producer_to_two_consumers_every_byte(daemon_factory, children) -> None:
    d = daemon_factory("--pool-mb", "256")
    daemon_fds = fd_count(d.pid)
    results = _run(children, d.runtime_dir, (False, True))  # one consumer takes views, the other copies
    expected = len(workers.cases()) + 1
    assert results == [("ok", expected), ("ok", expected)], results
    s = d.stats()
    pool = s["pools"][0]
    assert pool["used"] == 0 and pool["leases"] == {"RESERVED": 0, "PUBLISHED": 0}
    assert pool["largest_free"] == pool["capacity"], "free ranges did not coalesce back into one"
    assert (s["counters"]["reserves"] + s["counters"]["arena_publishes"] == expected
            and s["counters"]["frees"] == expected)
    assert s["counters"]["acks"] == 2 * expected and s["counters"]["over_acks"] == 0
    assert s["counters"]["fallbacks"] == {}
    assert_fds_settle(d.pid, daemon_fds)


def test_zero_copy_view_shares_pool_memory(daemon) -> None:
    with daemon.client(inline_threshold=0) as producer, daemon.client() as consumer:
        x = torch.arange(4096, dtype=torch.float32)
        desc = producer.put(x)
        view = consumer.get(desc)
        copy = consumer.get(desc, copy=True)
        # The producer's mapping and the consumer's are the same pages: a write through one shows in the other.
        producer.session.mapping(desc.pool).tensor[desc.offset : desc.offset + 4].view(torch.float32).fill_(-1.0)
        assert view[0].item() == -1.0 and copy[0].item() == 0.0
        consumer.ack(desc)
    assert daemon.pool()["used"] == 0


def test_shape_dtype_and_strides_round_trip(daemon) -> None:
    with daemon.client(inline_threshold=0) as c:
        for dtype in (torch.bfloat16, torch.float16, torch.complex64, torch.int8, torch.float8_e4m3fn):
            src = torch.ones(5, 6, 7).to(dtype).permute(2, 0, 1)  # non-contiguous
            desc = c.put(src)
            got = c.get(desc)
            assert got.dtype == dtype and got.shape == src.shape and got.is_contiguous()
            assert torch.equal(got.float(), src.float()) if dtype != torch.complex64 else torch.equal(got, src)
            c.ack(desc)
        scalar = c.put(torch.tensor(3.5))
        assert c.get(scalar).item() == 3.5 and c.get(scalar).shape == ()
        c.ack(scalar)
        empty = c.put(torch.empty(0, 4))
        assert empty.is_inline and c.get(empty).shape == (0, 4)
    assert daemon.pool()["used"] == 0


def test_lazy_views_are_written_as_the_values_they_show(daemon) -> None:
    """A contiguous CPU tensor goes into a host pool as one memmove of its memory; tensors whose memory
    differs from their values (a lazy conjugate or negation, a storage offset, a transposed view, a
    sparse one) must still arrive as the values they show."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + 0.5
    cplx = torch.complex(base, -base)
    cases = {
        "conj": cplx.conj(),  # a conjugate bit over unconjugated memory
        "neg": torch._neg_view(base),  # a negation bit over the positive memory
        "offset": base.reshape(-1)[5:17],  # contiguous, at a storage offset
        "transposed": base.t(),
        "conj of neg": torch._neg_view(cplx).conj(),
    }
    with daemon.client(inline_threshold=0) as c:
        for name, src in cases.items():
            desc = c.put(src)
            got = c.get(desc, copy=True)
            assert torch.equal(got, src.resolve_conj().resolve_neg()), name
            assert not got.is_conj() and not got.is_neg(), name
            c.ack(desc)
        with pytest.raises((TypeError, RuntimeError, NotImplementedError)):
            c.put(base.to_sparse())
    assert daemon.pool()["used"] == 0


def test_a_meta_tensor_is_refused_not_read_from_address_zero(daemon) -> None:
    """A meta tensor has a shape and no memory (its data_ptr is 0): put, through the pool or inline, raises
    torch's error instead of copying from address 0, which killed the process, and holds no pool space."""
    meta = torch.empty(1 << 16, device="meta")
    for threshold in (0, 1 << 30):  # the pool's memmove and the inline path's buffer
        with daemon.client(inline_threshold=threshold) as c:
            with pytest.raises(NotImplementedError, match="meta"):
                c.put(meta)
            desc = c.put(torch.ones(4))  # the client goes on working
            assert torch.equal(c.get(desc), torch.ones(4))
            c.ack(desc)
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the pool to empty")


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # torch warns once per process
def test_a_fake_tensor_is_refused_not_read_from_address_zero(daemon) -> None:
    """A FakeTensor (torch.compile's tracing) says it is a dense CPU tensor, yet has no memory: its data_ptr
    is 0. put, through the pool's memmove or the inline path's buffer, raises BAD_REQUEST instead of reading
    address 0, which killed the process, and holds no pool space."""
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    with fake_tensor.FakeTensorMode():
        fake = torch.ones(1 << 16)
    assert fake.is_cpu and fake.is_contiguous()
    for threshold in (0, 1 << 30):
        with daemon.client(inline_threshold=threshold) as c:
            c.ack(c.put(torch.ones(1 << 16)))  # a session, an arena and a descriptor head: the one-frame put
            with pytest.raises(MmfeatError, match="no memory") as e:
                c.put(fake)
            assert e.value.code == ErrorCode.BAD_REQUEST
            desc = c.put(torch.ones(4))  # the client goes on working
            assert torch.equal(c.get(desc), torch.ones(4))
            c.ack(desc)
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the pool to empty")


def test_a_write_past_the_pool_is_refused_not_made() -> None:
    """The memmove path checks the bounds torch's views would: a range from a confused or hostile daemon
    must raise, never write past the mapping."""
    from mmfeat.client.produce import packing

    pool = torch.zeros(4096, dtype=torch.uint8)
    src = torch.ones(512, dtype=torch.uint8)
    specs, _ = packing.layout([src])
    packing.write_into_pool(pool, 4096 - 512, [src], specs)  # exactly at the end: fine
    assert int(pool[-512:].sum()) == 512
    for offset in (4096 - 256, 4096, 1 << 40, -512):
        with pytest.raises(RuntimeError):
            packing.write_into_pool(pool, offset, [src], specs)
    assert int(pool.sum()) == 512


def test_descriptor_from_restarted_daemon_is_stale(runtime_dir, daemon_factory) -> None:
    d1 = daemon_factory("--pool-mb", "16", "--drain-timeout", "0")  # its lease is never acked
    with Client(runtime_dir, inline_threshold=0) as c:
        desc = c.put(torch.ones(1000))
    d1.stop()
    d1.proc.communicate()
    daemon_factory("--pool-mb", "16")
    with Client(runtime_dir) as c:
        try:
            c.get(desc)
        except Exception as exc:
            assert getattr(exc, "code", None) is not None and exc.code.value == "STALE", exc
        else:
            raise AssertionError("a descriptor from the previous daemon was readable")
        # The client reconnects to the new daemon on its own.
        fresh = c.put(torch.ones(1000), consumers=1)
        assert c.get(fresh).sum().item() == 1000
        c.ack(fresh)


def test_an_ack_of_a_descriptor_from_before_a_restart_never_counts_for_a_new_feature(
        runtime_dir, daemon_factory) -> None:
    # After a restart the first arena lands where the old one was and slot generations start again, so
    # the old descriptor names the same slot, generation and range as the new daemon's first feature:
    # only its epoch tells them apart.
    d1 = daemon_factory("--pool-mb", "16", "--drain-timeout", "0")
    with Client(runtime_dir, inline_threshold=0) as producer:
        old = producer.put(torch.ones(1000), consumers=2)
    d1.stop()
    d1.proc.communicate()
    d2 = daemon_factory("--pool-mb", "16")
    with Client(runtime_dir, inline_threshold=0) as producer, Client(runtime_dir) as consumer:
        new = producer.put(torch.ones(1000), consumers=2)
        assert (new.lease, new.gen, new.offset, new.nbytes) == (old.lease, old.gen, old.offset, old.nbytes) != ()
        consumer.ack(old)  # not waiting: refused by the new daemon as STALE, logged, never applied
        with pytest.raises(MmfeatError) as info:
            consumer.ack(old, wait=True)
        assert info.value.code is ErrorCode.STALE
        assert consumer.flush(5.0)
        assert consumer.ack(new, wait=True)["remaining"] == 1  # the new feature still waits for its second ack
        assert d2.stats()["counters"]["acks"] == 1
        consumer.ack(new)
    assert d2.pool()["leases"]["PUBLISHED"] == 0


def test_the_clients_bound_on_consumers_is_the_wires(daemon) -> None:
    """put, reserve and ack take every consumer count the daemon takes (protos' MAX_CONSUMERS) and refuse,
    before any request, the first one it would refuse."""
    from mmfeat.protos.messages import MAX_CONSUMERS

    with daemon.client(inline_threshold=0) as c:
        for make in (lambda n: c.put(torch.arange(1000, dtype=torch.int32), consumers=n),
                     lambda n: c.publish(torch.arange(1000, dtype=torch.int32, out=c.reserve((1000,), torch.int32,
                                                                                              consumers=n)))):
            desc = make(MAX_CONSUMERS)
            assert not desc.is_inline
            assert c.ack(desc, count=MAX_CONSUMERS, wait=True)["freed"]
            with pytest.raises(ValueError, match=f"between 1 and {MAX_CONSUMERS}"):
                make(MAX_CONSUMERS + 1)
        desc = c.put(torch.arange(1000, dtype=torch.int32))
        with pytest.raises(ValueError, match=f"between 1 and {MAX_CONSUMERS}"):
            c.ack(desc, count=MAX_CONSUMERS + 1)
        c.ack(desc)
    assert daemon.pool()["used"] == 0
