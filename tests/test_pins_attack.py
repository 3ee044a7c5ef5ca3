"""Attacks on pins (SPEC.md, sections 3, 5 and 12) against a real mmfeatd, with the attackers in processes
of their own: hostile members of the group rewriting ACKS words, racing pinners, hostile subscribers."""

from __future__ import annotations

import torch

from mmfeat.client import Namespace

from . import pin_attack_workers
from .test_keys import books_balance
from .test_keys import produced
from .test_pins import Pinner

NS = Namespace(framework="vllm", version="0.32.0", model="pins-attack", dtype="float32")


def _published(s: dict) -> int:
    return s["leases"]["PUBLISHED"]


def test_a_hostile_word_that_keeps_changing_pins_a_feature_no_longer_than_ack_ttl(daemon_factory, children) -> None:
    """A member of the group rewrites a retained feature's ACKS word between 1 and 2 pins taken, every
    50 ms. Its retain_ttl (1 s) passes: the daemon may wait for those pins ack_ttl (1 s) after it saw them,
    and no longer (SPEC.md, section 9: client bytes in the word pin a feature for ack_ttl at most)."""
    d = daemon_factory("--ack-ttl", "1")
    key = NS.key("flapped")
    with d.client() as c:
        desc = c.put(torch.ones(4096), key=key, retain_ttl=1.0)
        out, stop = children.Queue(), children.Queue()
        p = children.Process(target=pin_attack_workers.flapper, args=(str(d.runtime_dir), desc.to_bytes(), out, stop))
        p.start()
        try:
            assert out.get(timeout=60) == "started"
            # retain_ttl 1 s, then ack_ttl 1 s after the daemon saw the pins; 8 s leaves slack for sweeps.
            d.wait_for(lambda s: _published(s) == 0, timeout=8.0,
                       what="the flapped feature to end ack_ttl after its retain_ttl")
            assert out.get(timeout=30) > 0
        finally:
            stop.put("stop")
            p.join(30)
        assert p.exitcode == 0
        assert not c.has(key)


def test_no_pin_lands_once_the_free_waits_and_the_waited_pins_still_release(daemon, children) -> None:
    """A feature evicted while pinned waits for its pins, and takes no new one from then on (a late pin
    fails, took nothing, and its holder asks the daemon, which no longer finds the key); the reads it
    waits for still release it, and it is freed at the last, with no pin forgiven."""
    key = NS.key("frozen")
    produced(daemon, children, [key])
    pin = Pinner(daemon, children, key, 2)
    assert pin.pinned
    try:
        with daemon.client() as c:
            daemon.wait_for(lambda s: s["counters"]["table_pins"] == 2, what="the sweep to see the pin")
            assert c.evict(key)
            table = c._connect().table
            d = pin.desc
            args = (d.lease, d.gen, d.pool, d.offset, d.nbytes)
            assert not table.pin(*args, 1)  # the free began: no pin lands
            assert c.hold(key, count=1) is None  # the daemon finds no key either
            for _ in range(2):
                assert torch.equal(c.get(d, copy=True), torch.zeros(4096))
                c.ack(d)
            s = books_balance(daemon)
            assert s["counters"]["pins_forgiven"] == 0 and s["counters"]["table_pins"] == 2
    finally:
        pin.done()
