"""A reload (SIGHUP) that changes the TTLs while producers hold leases: each lease keeps the deadline it
was granted with, and a producer learns that deadline from the lease, not from hello."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from mmfeat.client.link.channel import ControlChannel
from mmfeat.protos import ErrorCode, MmfeatError

from .conftest import Daemon

BIG = (40, 1 << 20)  # more than half of a 128 MiB pool's arena: a reserved lease, not an arena placement


def _hello_ttls(runtime_dir: Path) -> tuple[float, float]:
    ch = ControlChannel(f"ipc://{runtime_dir}/mmfeatd.sock", 5)
    try:
        h = ch.call("hello")
        return h["reserve_ttl"], h["ack_ttl"]
    finally:
        ch.close()


def _reload(d: Daemon, cfg: Path, reserve_ttl: float, ack_ttl: float) -> None:
    cfg.write_text(f"[mmfeatd]\npool_mb = 128\nreserve_ttl = {reserve_ttl}\nack_ttl = {ack_ttl}\n")
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while _hello_ttls(d.runtime_dir) != (reserve_ttl, ack_ttl):
        assert time.monotonic() < deadline, "the reload did not apply"
        time.sleep(0.05)


@pytest.fixture
def reloadable(daemon_factory, runtime_dir: Path) -> tuple[Daemon, Path]:
    cfg = runtime_dir / "mmfeatd.toml"
    cfg.write_text("[mmfeatd]\npool_mb = 128\nreserve_ttl = 30.0\nack_ttl = 300.0\n")
    return daemon_factory("--config", str(cfg)), cfg


def test_a_reservation_under_a_shortened_reserve_ttl_is_refused_after_its_own_deadline(reloadable) -> None:
    """A producer whose hello said reserve_ttl 30 s reserves after a reload made it 0.5 s: once its lease
    has expired and a second producer reserved (another range: the expired one stays the first
    producer's), its publish raises STALE (it used to return a descriptor, refused only later in
    async_failures), and the second producer's consumer reads the second producer's bytes."""
    d, cfg = reloadable
    with d.client(inline_threshold=0, fallback="error") as first, \
            d.client(inline_threshold=0, fallback="error") as second, d.client() as consumer:
        first.connect()  # hello before the reload: it reported reserve_ttl 30 s
        _reload(d, cfg, reserve_ttl=0.5, ack_ttl=300.0)
        mine = first.reserve(BIG, torch.uint8)
        mine.fill_(0xAA)
        d.wait_for(lambda s: s["counters"]["expired"] == 1, what="the reservation to expire")
        theirs = second.reserve(BIG, torch.uint8)
        theirs.fill_(0x55)
        their_desc = second.publish(theirs)
        with pytest.raises(MmfeatError) as info:
            first.publish(mine)
        assert info.value.code is ErrorCode.STALE, info.value
        assert "reserve_ttl" in info.value.message and "0.5" in info.value.message
        view = consumer.get(their_desc)
        assert bool((view == 0x55).all()), "the second producer's feature holds another producer's bytes"
        del view
        consumer.ack(their_desc)
        assert first.async_failures == {} and second.async_failures == {}
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the pool to empty")


def test_a_lease_granted_before_a_reload_keeps_its_deadline(reloadable) -> None:
    """Shortening reserve_ttl does not shorten a reservation already granted: reserved under 30 s, it
    publishes after the reloaded 0.5 s have passed, and its consumer reads its bytes."""
    d, cfg = reloadable
    with d.client(inline_threshold=0, fallback="error") as producer, d.client() as consumer:
        kept = producer.reserve(BIG, torch.uint8)
        _reload(d, cfg, reserve_ttl=0.5, ack_ttl=300.0)
        probe = producer.reserve(BIG, torch.uint8)  # granted under the new 0.5 s
        d.wait_for(lambda s: s["counters"]["expired"] == 1, what="the reservation granted after the reload to expire")
        kept.fill_(7)
        desc = producer.publish(kept)
        assert bool((consumer.get(desc) == 7).all())
        consumer.ack(desc)
        with pytest.raises(MmfeatError) as info:
            producer.publish(probe)
        assert info.value.code is ErrorCode.STALE
        _reload(d, cfg, reserve_ttl=30.0, ack_ttl=300.0)
        again = producer.reserve(BIG, torch.uint8)  # back to 30 s: a quick publish is fine
        again.fill_(9)
        desc = producer.publish(again)
        assert bool((consumer.get(desc) == 9).all())
        consumer.ack(desc)
        assert producer.async_failures == {}
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the pool to empty")
