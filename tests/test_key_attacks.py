"""Keyed and retained features under attack: a peer of the group writing the lease table, two producers
racing on one key, puts whose consumer counts must not be merged, keys that are no UTF-8, and the
books after each (SPEC.md, section 3, "Keys and lifetimes"; section 9)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmfeat.client import Client, ErrorCode, MmfeatError, Namespace
from mmfeat.protos.lease_table import ACK_COUNT_MASK, DONE, PUBLISHED, STATE, state_word

from . import key_workers
from .conftest import start_daemon
from .test_keys import books_balance
from .test_table_attacks import HostileTable

NS = Namespace(framework="vllm", version="0.32.0", model="Qwen/Qwen2-VL", dtype="bfloat16")
MIB = 1 << 20


def test_two_counted_puts_under_one_key_each_keep_their_consumers(daemon) -> None:
    """Two producers put the same item, counted, under one key: each put's consumers read what it
    handed them, however the other put's consumers ack."""
    key = NS.key("same-image")
    with daemon.client() as a, daemon.client() as b:
        da = a.put(torch.ones(4096), key=key, consumers=1)
        db = b.put(torch.ones(4096), key=key, consumers=1)
        a.ack(da)
        a.flush()
        assert torch.equal(b.get(db, copy=True), torch.ones(4096))
        b.ack(db)
        # Raced: both reserved before either published.
        ra = a.reserve((4096,), torch.float32, key=key, consumers=1)
        rb = b.reserve((4096,), torch.float32, key=key, consumers=1)
        ra.fill_(1)
        rb.fill_(2)
        da, db = a.publish(ra), b.publish(rb)
        assert b.lookup(key).to_bytes() == da.to_bytes()
        a.ack(da)
        a.flush()
        assert torch.equal(b.get(db, copy=True), torch.full((4096,), 2.0))
        b.ack(db)
    books_balance(daemon)


def test_two_retained_puts_racing_on_one_key_make_one_feature(daemon) -> None:
    key = NS.key("raced")
    with daemon.client() as a, daemon.client() as b:
        ra = a.reserve((4096,), torch.float32, key=key, retain_ttl=300.0)
        rb = b.reserve((4096,), torch.float32, key=key, retain_ttl=300.0)
        ra.fill_(1)
        rb.fill_(2)
        db = b.publish(rb)
        da = a.publish(ra)  # the second publish lets its own bytes go and answers the first feature
        assert da.to_bytes() == db.to_bytes() == a.lookup(key).to_bytes()
        assert torch.equal(a.get(da, copy=True), torch.full((4096,), 2.0))
        s = daemon.stats()
        assert s["leases"]["PUBLISHED"] == 1 and s["counters"]["dedups"] == 1
        assert b.evict(key)
    books_balance(daemon)


def test_a_peers_done_in_a_retained_features_slot_is_put_back(daemon) -> None:
    """No count of acks ends a retained feature: a DONE a peer writes into its slot is refused, and the
    feature stays readable by key."""
    key = NS.key("kept")
    with daemon.client() as c:
        hostile = HostileTable(daemon, c)
        try:
            d = c.put(torch.ones(4096), key=key, retain_ttl=300.0)
            hostile.write(d.lease, STATE, state_word(d.gen, DONE))
            s = daemon.stats()
            assert s["counters"]["bad_table_words"] == 1 and s["leases"]["PUBLISHED"] == 1
            assert hostile.read(d.lease, STATE) == state_word(d.gen, PUBLISHED)
            assert c.has(key) and torch.equal(c.get(key=key, copy=True), torch.ones(4096))
            assert c.evict(key)
        finally:
            hostile.close()
    books_balance(daemon)


@pytest.mark.parametrize("name", ["\ud800", "img\udcff"])
def test_a_key_that_is_no_utf8_is_a_typed_refusal(daemon, name: str) -> None:
    with daemon.client() as c:
        for call in (lambda: NS.key(name), lambda: c.has(f"{NS.id}/{name}"),
                     lambda: c.put(torch.ones(4096), key=f"{NS.id}/{name}", retain_ttl=5.0)):
            with pytest.raises(MmfeatError) as e:
                call()
            assert e.value.code is ErrorCode.BAD_REQUEST and "UTF-8" in str(e.value)
    books_balance(daemon)


def test_namespace_fields_with_nul_are_refused_so_no_two_namespaces_share_an_id() -> None:
    with pytest.raises(ValueError):
        Namespace("a\0b", "c", "m", "d")
    with pytest.raises(ValueError):
        Namespace("a", "b", "m", "d", prefix="p\0")


def test_a_scheduler_across_a_restart_misses_once_then_holds_on_the_new_daemon(runtime_dir) -> None:
    """The connector's scheduler saw the key (has), the daemon restarted, then it holds: that hold
    misses (the key is gone with the epoch), and the same client holds on the new daemon after."""
    key = NS.key("across")
    d = start_daemon(runtime_dir, "--pool-mb", "16")
    scheduler = Client(runtime_dir, map_pools=False, timeout=5.0)
    try:
        with Client(runtime_dir) as p:
            p.put(torch.ones(4096), key=key, retain_ttl=300.0)
        assert scheduler.has_many([key]) == [True]
        assert d.stop() == 0
        d.proc.communicate()
        d = start_daemon(runtime_dir, "--pool-mb", "16")
        assert scheduler.hold(key, count=2) is None
        with Client(runtime_dir) as p:
            p.put(torch.full((4096,), 3.0), key=key, retain_ttl=300.0)
            assert scheduler.has(key)
            h = scheduler.hold(key, count=1)
            assert h is not None and d.stats()["holds"] == 1
            assert torch.equal(p.get(h, copy=True), torch.full((4096,), 3.0))
            p.ack(h)
            p.flush()
        assert d.stats()["holds"] == 0 and scheduler.evict(key)
        books_balance(d)
    finally:
        scheduler.close()
        d.stop()


def test_a_holds_descriptor_acked_past_its_count_ends_that_hold_only(daemon) -> None:
    """Acks beyond a hold's count (a rank retrying, a forged copy) end no other hold and never the
    feature while another hold lives; acks of the feature's own descriptor change nothing."""
    key = NS.key("acked-often")
    with daemon.client() as c, daemon.client(map_pools=False) as scheduler:
        d = c.put(torch.ones(4096), key=key, retain_ttl=300.0)
        h1, h2 = scheduler.hold(key, count=1), scheduler.hold(key, count=1)
        assert h1.lease != h2.lease
        c.ack(h1)
        for _ in range(3):
            with pytest.raises(MmfeatError) as e:
                c.request("ack", lease=h1.lease_ref(), count=1)
            assert e.value.code in (ErrorCode.NOT_FOUND, ErrorCode.STALE)
        forged = dataclasses.replace(h2, token=bytes(16))
        with pytest.raises(MmfeatError) as e:
            c.request("ack", lease=forged.lease_ref(), count=4096)
        assert e.value.code is ErrorCode.FORBIDDEN
        for _ in range(5):
            c.ack(d)
        assert scheduler.evict(key)  # held by h2: its bytes stay
        c.flush()
        assert daemon.stats()["holds"] == 1
        assert torch.equal(c.get(h2, copy=True), torch.ones(4096))
        c.ack(h2)
        c.flush()
    books_balance(daemon)


def test_keys_at_the_limits(daemon) -> None:
    """128 keys of 256 bytes each (multi-byte names) in one lookup fit a frame; 129 are TOO_LARGE from
    the client and from the daemon alike; a retain_ttl the client would refuse is refused on the wire."""
    stem = NS.key("x")[:-1]
    names = [("é" * 200)[: (256 - len(stem) - 3) // 2] + f"{i:03d}" for i in range(129)]
    keys = [stem + n for n in names]
    assert all(len(k.encode()) in (255, 256) for k in keys)
    with daemon.client() as c:
        c.put(torch.ones(4096), key=keys[127], retain_ttl=300.0)
        assert c.has_many(keys[:128]) == [False] * 127 + [True]
        with pytest.raises(MmfeatError) as e:
            c.has_many(keys)
        assert e.value.code is ErrorCode.TOO_LARGE
        with pytest.raises(MmfeatError) as e:
            c.request("lookup_key", keys=keys)
        assert e.value.code in (ErrorCode.TOO_LARGE, ErrorCode.BAD_REQUEST)
        session = c.request("hello")["session"]
        for ttl in (0, -1.0, float("nan"), float("inf"), 1e12):
            with pytest.raises(MmfeatError) as e:
                c.request("reserve", session=session, nbytes=4096, retain_ttl=ttl, key=NS.key("ttl"))
            assert e.value.code is ErrorCode.BAD_REQUEST
        assert c.evict(keys[127])
    books_balance(daemon)


def test_a_producer_at_max_session_leases_evicts_its_own_oldest_unheld_retained_features(daemon_factory) -> None:
    """Retained features are a cache: a producer whose retained features fill its max_session_leases has
    its own oldest unheld ones evicted for its next put, which stays in the pool, never a held one."""
    d = daemon_factory("--pool-mb", "16", "--max-session-leases", "4")
    keys = [NS.key(f"own{i}") for i in range(7)]
    with d.client(fallback="error") as producer, d.client(map_pools=False) as scheduler:
        for i, k in enumerate(keys[:4]):
            producer.put(torch.full((4096,), float(i)), key=k, retain_ttl=300.0)
        h = scheduler.hold(keys[0], count=1)
        for i, k in enumerate(keys[4:], 4):
            assert not producer.put(torch.full((4096,), float(i)), key=k, retain_ttl=300.0).is_inline
        assert producer.has_many(keys) == [True, False, False, False, True, True, True]
        assert d.stats()["counters"]["evictions"] == 3
        assert torch.equal(producer.get(h, copy=True), torch.zeros(4096))
        producer.ack(h)
        producer.flush()
        assert all(producer.evict(k) for k in (keys[0], *keys[4:]))
    books_balance(d)


def test_a_holder_that_holds_every_key_is_bounded_by_max_session_leases(daemon_factory) -> None:
    """A member of the group holds all it can: its holds are capped by max_session_leases (holds hold no
    bytes of their own, so max_session_mb does not cap what they keep), and its end ends every hold."""
    d = daemon_factory("--pool-mb", "16", "--max-session-leases", "4")
    keys = [NS.key(f"hog{i}") for i in range(6)]
    for half in (keys[:3], keys[3:]):
        with d.client(fallback="error") as producer:
            for k in half:
                producer.put(torch.full((MIB // 4,), float(keys.index(k))), key=k, retain_ttl=300.0)
    hog = d.client(map_pools=False)
    try:
        holds = [hog.hold(k, count=4096) for k in keys[:4]]
        assert all(h is not None for h in holds)
        with pytest.raises(MmfeatError) as e:
            hog.hold(keys[4], count=1)
        assert e.value.code is ErrorCode.OVER_QUOTA and "max_session_leases" in str(e.value)
    finally:
        hog.close()
    s = d.wait_for(lambda s: s["holds"] == 0, timeout=30, what="the hog's holds to end")
    assert s["counters"]["holds_reclaimed"] == 4
    with d.client() as c:
        assert [c.evict(k) for k in keys] == [True] * 6
    books_balance(d)


def test_producers_in_four_processes_racing_on_the_same_keys_make_one_feature_per_key(daemon, children) -> None:
    """Each key ends with exactly one feature, every producer was handed that feature's descriptor, whose
    bytes are one whole put's (never a mix), and nothing else is left in the pool."""
    keys = [NS.key(f"race{i}") for i in range(24)]
    go, q = children.Event(), children.Queue()
    procs = [children.Process(target=key_workers.racing_producer, args=(str(daemon.runtime_dir), keys, float(v), go, q))
             for v in range(1, 5)]
    for p in procs:
        p.start()
    go.set()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    with daemon.client() as c:
        for i, k in enumerate(keys):
            live = c.lookup(k)
            assert {r[i][0] for r in results} == {live.to_bytes()}
            t = c.get(live, copy=True)
            assert len({r[i][1] for r in results}) == 1 and torch.equal(t, torch.full((4096,), t[0].item()))
        s = c.stats()
        assert s["leases"]["PUBLISHED"] == len(keys) and s["namespaces"][NS.id]["keys"] == len(keys)
        # At least three puts per key were answered with the live feature (a reserve under a live key
        # counts once more: the client then puts, which asks again).
        assert s["counters"]["dedups"] >= 3 * len(keys)
        assert all(c.evict(k) for k in keys)
    books_balance(daemon)


def test_a_zero_copy_view_read_under_a_hold_survives_an_evict_and_the_pools_reuse(daemon) -> None:
    with daemon.client() as c, daemon.client(map_pools=False) as scheduler:
        key = NS.key("viewed")
        c.put(torch.ones(65536), key=key, retain_ttl=300.0)
        h = scheduler.hold(key, count=1)
        view = c.get(h)
        assert c.evict(key)  # held: its bytes stay
        c.put(torch.full((65536,), 9.0), key=NS.key("next"), retain_ttl=300.0)
        assert torch.equal(view, torch.ones(65536))
        del view
        c.ack(h)
        assert c.evict(NS.key("next"))
    books_balance(daemon)


@pytest.mark.xfail(strict=True, reason="a limit (reliability.md, What does not hold): a zero-copy view of a retained "
                   "feature read without a hold is not protected; its range is reused once it is evicted")
def test_a_zero_copy_view_read_by_key_without_a_hold_survives_an_evict(daemon) -> None:
    with daemon.client() as c:
        key = NS.key("unheld-view")
        c.put(torch.ones(65536), key=key, retain_ttl=300.0)
        view = c.get(key=key)
        assert c.evict(key)
        c.put(torch.full((65536,), 9.0), key=NS.key("over"), retain_ttl=300.0)
        try:
            assert torch.equal(view, torch.ones(65536))
        finally:
            c.evict(NS.key("over"))


def test_a_put_larger_than_the_whole_session_quota_evicts_nothing_of_its_producer(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "16", "--max-session-mb", "1")
    keys = [NS.key(f"small{i}") for i in range(3)]
    with d.client() as producer:
        for k in keys:
            producer.put(torch.ones(4096), key=k, retain_ttl=300.0)
        assert producer.put(torch.ones(MIB), key=NS.key("huge"), retain_ttl=300.0).is_inline
        assert producer.fallbacks["over_quota"] == 1 and producer.has_many(keys) == [True] * 3
        assert all(producer.evict(k) for k in keys)
    books_balance(d)


def test_binds_that_name_what_their_sender_does_not_hold_are_refused_and_change_nothing(daemon) -> None:
    """A retained feature stored in its producer's arena awaits its bind. Another session's bind of it,
    a bind with a wrong generation or a forged token, and its own producer's binds with an oversized or
    foreign descriptor, without a retain_ttl, or with nothing to bind, are each a typed refusal that
    leaves it as it was: unbound, found by no key. Then its producer's own bind binds it, once."""
    key, other = NS.key("awaited"), NS.key("template")
    with daemon.client(fallback="error") as c, daemon.client() as b:
        victim = HostileTable(daemon, c)  # the producer's own session, at the protocol's level
        try:
            arena = victim.arena()
            slot, pool, offset = arena["slot_base"], arena["pool"], arena["offset"]
            gen = (victim.read(slot, STATE) >> 2) + 1
            victim.publish(slot, gen, pool, offset, 4096, consumers=ACK_COUNT_MASK)
            token = (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
            template = b.put(torch.ones(1024), key=other, retain_ttl=300.0, wait=False)  # a real descriptor
            ref = {"pool": pool, "epoch": template.epoch, "lease": slot, "gen": gen, "token": token,
                   "offset": offset, "nbytes": 4096}
            desc = dataclasses.replace(template, pool=pool, lease=slot, gen=gen, token=token, offset=offset)
            bind = {"key": key, "retain_ttl": 300.0, "descriptor": desc.to_bytes()}
            for lease, code in ((ref, ErrorCode.FORBIDDEN), ({**ref, "gen": gen + 1}, ErrorCode.STALE),
                                ({**ref, "token": bytes(16)}, ErrorCode.FORBIDDEN)):
                with pytest.raises(MmfeatError) as e:
                    b.request("bind", session=b.session.token, lease=lease, **bind)
                assert e.value.code is code, e.value
            for fields in ({**bind, "descriptor": b"\x01" * 2049}, {**bind, "descriptor": template.to_bytes()},
                           {"key": key, "descriptor": desc.to_bytes()}, {}):
                reply = victim.request("bind", lease=ref, **fields)
                assert not reply["ok"] and reply["error"]["code"] == "BAD_REQUEST", reply
            # A reserved lease takes its key at reserve: a bind of one is refused too.
            r = b.request("reserve", session=b.session.token, nbytes=4096)["lease"]
            with pytest.raises(MmfeatError) as e:
                b.request("bind", session=b.session.token, lease=r, retain_ttl=5.0)
            assert e.value.code is ErrorCode.BAD_STATE
            b.request("release", session=b.session.token, lease=r)
            s = daemon.stats()
            assert s["counters"]["binds"] == 1 and not b.has(key)  # the template's bind alone
            assert b.request("lookup", lease=ref)["state"] == "PUBLISHED"
            assert victim.request("bind", lease=ref, **bind)["ok"]
            assert b.lookup(key).to_bytes() == desc.to_bytes()
            assert victim.request("bind", lease=ref, **bind)["error"]["code"] == "BAD_STATE"
        finally:
            victim.close()
        assert b.evict(key) and b.evict(other)
    books_balance(daemon)
