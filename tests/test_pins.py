"""Pins: a retained feature protected for a number of reads by a compare-and-swap in its own ACKS word,
without a message (SPEC.md, section 3, "Keys and lifetimes", and section 5), against a real daemon with
the producer, the pinner and the reader in processes of their own."""

from __future__ import annotations

import os
import signal

import torch

from mmfeat.client import Descriptor, Namespace
from mmfeat.protos.lease_table import ACKS, PIN_MAX, ack_word, word_offset

from . import key_workers
from .test_keys import books_balance, produced

NS = Namespace(framework="vllm", version="0.32.0", model="pins", dtype="float32")
MIB = 1 << 20


class Pinner:
    """key_workers.pinner in a process: pinned on start, exits on ``done``, or is killed."""

    def __init__(self, daemon, children, key: str, count: int) -> None:
        self.out, self.go = children.Queue(), children.Queue()
        self.proc = children.Process(target=key_workers.pinner,
                                     args=(str(daemon.runtime_dir), key, count, self.out, self.go))
        self.proc.start()
        blob, self.pinned = self.out.get(timeout=60)
        self.desc = Descriptor.from_bytes(blob)

    def done(self) -> None:
        self.go.put("exit")
        self.proc.join(30)
        assert self.proc.exitcode == 0

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(30)


def test_a_pinned_feature_outlives_its_eviction_until_its_reads_are_acked(daemon, children) -> None:
    key = NS.key("evicted")
    produced(daemon, children, [key])
    pin = Pinner(daemon, children, key, 2)
    assert pin.pinned
    with daemon.client() as c:
        s = daemon.wait_for(lambda s: s["counters"]["table_pins"] == 2, what="the sweep to see the pin")
        assert s["pins"] == 2
        evicted_before = s["counters"]["evicted_by_key"]
        assert c.evict(key)  # evicted, but its bytes stay for the two pinned reads
        assert not c.has(key)
        s = daemon.stats()
        assert s["leases"]["PUBLISHED"] == 1 and s["counters"]["evicted_by_key"] == evicted_before + 1
        for _ in range(2):
            assert torch.equal(c.get(pin.desc, copy=True), torch.zeros(4096))
            c.ack(pin.desc)
        s = books_balance(daemon)
        assert s["counters"]["pins_forgiven"] == 0 and s["pins"] == 0
    pin.done()


def test_pressure_passes_over_a_pinned_feature_seen_or_not(daemon_factory, children) -> None:
    d = daemon_factory("--pool-mb", "16")
    k = [NS.key(f"p{i}") for i in range(5)]
    with d.client() as c:
        for i in range(3):
            c.put(torch.full((5 * MIB // 4,), float(i)), key=k[i], retain_ttl=300.0)
        seen = Pinner(d, children, k[0], 1)  # the oldest, pinned, and swept before the pressure comes
        d.wait_for(lambda s: s["counters"]["table_pins"] == 1, what="the sweep to see the pin")
        assert not c.put(torch.full((5 * MIB // 4,), 3.0), key=k[3], retain_ttl=300.0).is_inline
        assert c.has_many(k[:4]) == [True, False, True, True]
        # Pinned and at once pressed for room, before any sweep: the daemon's close of its word finds
        # the pin, so the feature loses its key but keeps its bytes for the pinned read.
        unseen = Pinner(d, children, k[2], 1)
        assert unseen.pinned
        assert not c.put(torch.full((5 * MIB // 4,), 4.0), key=k[4], retain_ttl=300.0).is_inline
        for p, value in ((seen, 0.0), (unseen, 2.0)):
            assert torch.equal(c.get(p.desc, copy=True), torch.full((5 * MIB // 4,), value))
            c.ack(p.desc)
        for key in k:
            c.evict(key)
        books_balance(d)
        seen.done()
        unseen.done()


def test_a_dead_pinners_pins_are_waited_for_ack_ttl_then_forgiven(daemon_factory, children) -> None:
    d = daemon_factory("--ack-ttl", "1")
    key = NS.key("dead")
    produced(d, children, [key])
    pin = Pinner(d, children, key, 3)
    assert pin.pinned
    pin.kill()
    with d.client() as c:
        d.wait_for(lambda s: s["counters"]["table_pins"] == 3, what="the sweep to see the pin")
        assert c.evict(key)
        s = books_balance(d)  # nobody acks: ack_ttl after the daemon saw the pins, it frees the feature
        assert s["counters"]["pins_forgiven"] == 3


def test_pins_fail_where_they_would_protect_nothing(daemon, children) -> None:
    retained, counted = NS.key("r"), NS.key("c")
    produced(daemon, children, [retained])
    with daemon.client() as c:
        c.put(torch.ones(4096), key=counted, consumers=1)
        table = c._connect().table
        for key in (retained, counted):
            desc = c.lookup(key)
            args = (desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes)
            if key == counted:
                assert not table.pin(*args, 1)  # a counted feature: its consumer count protects it
                c.get(desc, copy=True)
                c.ack(desc)
                continue
            # An ack without a pin releases nothing (it goes as a message, counted in retained_acks).
            acks = daemon.stats()["counters"]["retained_acks"]
            assert not table.add_acks(*args, 1)
            c.ack(desc)
            assert daemon.stats()["counters"]["retained_acks"] == acks + 1
            assert not table.pin(*args, PIN_MAX + 1) and not table.pin(*args[:4], desc.nbytes + 1, 1)
            assert table.pin(*args, PIN_MAX) and not table.pin(*args, 1)  # at its limit
            assert table.add_acks(*args, 4) and table.add_acks(*args, PIN_MAX - 4)
            assert not table.add_acks(*args, 1)  # never more releases than pins
            assert c.evict(key)
            assert not table.pin(*args, 1)  # the daemon closed the word and freed the feature
        books_balance(daemon)


def test_a_hostile_pins_word_is_bounded_by_ack_ttl(daemon_factory, children) -> None:
    d = daemon_factory("--ack-ttl", "1")
    keys = [NS.key("h0"), NS.key("h1")]
    descs = [Descriptor.from_bytes(b) for b in produced(d, children, keys)]
    with d.client() as c:
        table = c._connect().table
        slots = table.slots
        words = [ack_word(descs[0].gen, PIN_MAX), ack_word(descs[1].gen + 1, 5)]  # pinned for ever; another gen
        for desc, word in zip(descs, words):
            table.mm[word_offset(slots, desc.lease, ACKS):word_offset(slots, desc.lease, ACKS) + 8] = \
                word.to_bytes(8, "little")
        assert c.ping() is not None
        for key in keys:
            c.evict(key)
        books_balance(d)  # the first at ack_ttl, the second at once
        assert c.ping() is not None
