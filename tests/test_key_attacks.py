"""Keyed and retained features under attack: a peer of the group writing the lease table, two producers
racing on one key, puts whose consumer counts must not be merged, keys that are no UTF-8, and the
books after each (SPEC.md, section 3, "Keys and lifetimes"; section 9)."""

from __future__ import annotations

import pytest
import torch

from mmfeat.client import ErrorCode, MmfeatError, Namespace
from mmfeat.protos.lease_table import DONE, PUBLISHED, STATE, state_word

from .test_keys import books_balance
from .test_table_attacks import HostileTable

NS = Namespace(framework="vllm", version="0.32.0", model="Qwen/Qwen2-VL", dtype="bfloat16")


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
