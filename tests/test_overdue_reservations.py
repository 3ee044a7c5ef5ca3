"""A producer slower than its reservation: past reserve_ttl its range goes to no other feature while its
session lives, every publish path refuses it with STALE, and its range comes back at its publish, its
discard or its death, counted against its quota until then.

Each producer is a process of its own that writes when the test tells it to: after the daemon's stats
showed the reservation's reserve_ttl passed, and after another producer's reserve was served. Short
TTLs apply only to the reservations meant to run late (a reload sets them), never to one that must be
published in time.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from . import overdue_workers
from .conftest import Daemon
from .test_reloads import _reload, reloadable  # noqa: F401  (a fixture: the tests ask for it by name)

BIG = 40 << 20  # more than half of a 128 MiB pool's arena: a reserved lease, not an arena placement
SMALL = 4096


class _Producer:
    """A producer process driven one step at a time (tests/overdue_workers.py)."""

    def __init__(self, children: Any, d: Daemon) -> None:
        self.commands, self.results = children.Queue(), children.Queue()
        self.proc = children.Process(target=overdue_workers.producer,
                                     args=(str(d.runtime_dir), self.commands, self.results))
        self.proc.start()
        kind, self.pid = self.results.get(timeout=60)
        assert kind == "ready", self.pid

    def ask(self, *command: Any) -> tuple:
        self.commands.put(command)
        reply = self.results.get(timeout=60)
        assert reply[0] != "error", reply
        return reply

    def finish(self) -> dict:
        """Close its client and exit; the asynchronous failures its client counted."""
        kind, failures = self.ask("exit")
        assert kind == "async_failures"
        self.proc.join(30)
        assert self.proc.exitcode == 0
        return failures

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(30)


def _read(children: Any, d: Daemon, blob: bytes, value: int) -> tuple:
    """A consumer process's read of ``blob``: ("read", every byte is ``value``, its READY word is set)."""
    results = children.Queue()
    proc = children.Process(target=overdue_workers.consumer, args=(str(d.runtime_dir), blob, value, results))
    proc.start()
    out = results.get(timeout=60)
    proc.join(30)
    return out


def _disjoint(a: int, b: int, size: int) -> bool:
    return a + size <= b or b + size <= a


def test_a_slow_producers_late_writes_land_in_no_other_producers_feature(reloadable, children) -> None:  # noqa: F811
    """The slow producer's reservation outlives its reserve_ttl (a reload lowered it to 0.5 s); once the
    daemon shows it expired, a second producer reserves, fills and publishes a feature of the same size,
    and only then does the slow one write its bytes and publish. The second producer was given another
    range (the expired one is kept, counted in expired_reserved and against the slow one's quota), its
    consumer reads its bytes alone, the slow publish raises STALE, and every range comes back."""
    d, cfg = reloadable
    slow, fast = _Producer(children, d), _Producer(children, d)
    try:
        _reload(d, cfg, reserve_ttl=0.5, ack_ttl=300.0)
        _, _, slow_at = slow.ask("reserve", BIG, None)
        kept = d.wait_for(lambda s: s["counters"]["expired"] == 1, what="the slow reservation's reserve_ttl to pass")
        _reload(d, cfg, reserve_ttl=30.0, ack_ttl=300.0)  # a reload leaves a kept range kept
        _, _, fast_at = fast.ask("reserve", BIG, None)
        _, blob = fast.ask("publish", 0x55)
        late = slow.ask("publish", 0xAA)  # the slow producer's write: after the fast one's reserve was served
        read = _read(children, d, blob, 0x55)
        end = d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="every range back")
        failures = [slow.finish(), fast.finish()]
    finally:
        slow.kill()
        fast.kill()
    assert read == ("read", True, True), f"the fast producer's consumer read {read}"
    assert _disjoint(slow_at, fast_at, BIG), f"the fast producer got the slow one's range: {slow_at} and {fast_at}"
    assert late[:2] == ("refused", "STALE") and "reserve_ttl" in late[2], late
    assert kept["expired_reserved"] == 1 and kept["leases"] == {"RESERVED": 1, "PUBLISHED": 0}, kept
    pool = kept["pools"][0]
    assert pool["bytes"]["RESERVED"] == BIG and pool["used"] - pool["arenas"]["bytes"] == BIG, pool
    assert end["expired_reserved"] == 0 and end["leases"] == {"RESERVED": 0, "PUBLISHED": 0}
    assert end["counters"]["publishes"] == 1 and end["counters"]["releases"] == 1, end["counters"]
    assert failures == [{}, {}]


def test_an_expired_reservation_counts_against_its_quota_until_its_discard_or_its_producers_death(
        daemon_factory, children) -> None:
    """A producer whose reservations keep running late holds no more than max_session_mb: two kept
    ranges of 40 MiB, then OVER_QUOTA. A discard gives one back, the producer's death the other."""
    d = daemon_factory("--pool-mb", "128", "--reserve-ttl", "0.5", "--max-session-mb", "100")
    p = _Producer(children, d)
    try:
        for n in (1, 2):
            assert p.ask("reserve", BIG, None)[0] == "reserved"
            d.wait_for(lambda s: s["expired_reserved"] == n, what=f"reservation {n} to be kept past reserve_ttl")
        refused = p.ask("reserve", BIG, None)
        full = d.stats()
        assert p.ask("discard") == ("discarded",)
        one = d.wait_for(lambda s: s["expired_reserved"] == 1, what="the discard to give one range back")
        os.kill(p.pid, signal.SIGKILL)
        gone = d.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=20, what="the dead producer's range back")
    finally:
        p.kill()
    assert refused[:2] == ("refused", "OVER_QUOTA"), refused
    assert full["pools"][0]["bytes"]["RESERVED"] == 2 * BIG and full["leases"]["RESERVED"] == 2, full["pools"]
    assert full["counters"]["over_quota"] == 1 and full["counters"]["expired"] == 2
    assert one["pools"][0]["bytes"]["RESERVED"] == BIG and one["counters"]["releases"] == 1
    assert gone["expired_reserved"] == 0 and gone["leases"]["RESERVED"] == 0
    assert gone["counters"]["reclaimed_on_disconnect"] == 1 and gone["counters"]["expired"] == 2


def test_a_retained_reservation_published_past_its_deadline_is_refused_and_its_slot_goes_on_clean(
        reloadable, children) -> None:  # noqa: F811
    """A retained reservation (no key) published after its reserve_ttl raises STALE, as every other
    publish does: nothing is published and its slot comes back. A bare publish request past the deadline
    is refused by the daemon alike. The next owner of the slot publishes in it and its consumer reads
    its bytes, its READY word naming its own generation."""
    d, cfg = reloadable
    late, nxt = _Producer(children, d), _Producer(children, d)
    try:
        _reload(d, cfg, reserve_ttl=0.5, ack_ttl=300.0)
        _, slot, _ = late.ask("reserve", SMALL, 300.0)
        d.wait_for(lambda s: s["expired_reserved"] == 1, what="the retained reservation's reserve_ttl to pass")
        refused = late.ask("publish", 7)
        assert refused[:2] == ("refused", "STALE") and "reserve_ttl" in refused[2], refused
        _, raw_slot, _ = late.ask("raw_reserve", SMALL, 300.0)
        d.wait_for(lambda s: s["expired_reserved"] == 1, what="the bare reservation's reserve_ttl to pass")
        raw_refused = late.ask("raw_publish")
        assert raw_refused[:2] == ("refused", "STALE") and "past its deadline" in raw_refused[2], raw_refused
        after = d.stats()
        _reload(d, cfg, reserve_ttl=30.0, ack_ttl=300.0)
        _, next_slot, _ = nxt.ask("reserve", BIG, None)
        _, blob = nxt.ask("publish", 9)
        read = _read(children, d, blob, 9)
        end = d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="every range back")
        failures = [late.finish(), nxt.finish()]
    finally:
        late.kill()
        nxt.kill()
    assert after["counters"]["publishes"] == 0 and after["counters"]["late_publishes"] == 1, after["counters"]
    assert after["leases"]["RESERVED"] == 0 and after["expired_reserved"] == 0
    assert raw_slot == slot == next_slot, (slot, raw_slot, next_slot)  # the lowest free slot, each time
    assert read == ("read", True, True), f"the slot's next owner's consumer read {read}"
    assert end["counters"]["publishes"] == 1 and end["leases"] == {"RESERVED": 0, "PUBLISHED": 0}
    assert failures == [{}, {}]


def test_a_late_publish_behind_a_gpu_stream_keeps_its_range_until_the_stream_wrote_it() -> None:
    """The daemon's own table and ledger in this process, the clock passed in: a GPU reservation published
    past its deadline with stream_ready is refused STALE and nothing is published, but its range and slot
    go back only once its READY word shows the stream's write landed (a late copy or READY store must not
    reach the slot's next owner), and no later than ack_ttl."""
    from mmfeat.daemon.leases.allocator import Allocator
    from mmfeat.daemon.leases.arenas import Arenas
    from mmfeat.daemon.leases.counters import Counters
    from mmfeat.daemon.leases.lease_table import LeaseTable
    from mmfeat.daemon.leases.ledger import Ledger
    from mmfeat.daemon.leases.session_books import SessionBooks
    from mmfeat.daemon.leases.slots import SlotSpace
    from mmfeat.protos import ErrorCode, MmfeatError
    from mmfeat.protos.messages import LeaseRef

    table, counters = LeaseTable(64, 7), Counters()
    allocators, space = {0: Allocator(1 << 20)}, SlotSpace(64, 16)
    books = SessionBooks(counters)
    ledger = Ledger(allocators, 7, counters, 1.0, 10.0, space, Arenas(allocators, space, counters, books, 0, 4),
                    books, (), table)
    ledger.gpu_pools = frozenset({0})
    me = b"p" * 16
    try:
        for written in (True, False):
            lease = ledger.reserve(me, 0, 4096, 1, now=100.0)
            ref = LeaseRef(pool=0, epoch=7, lease=lease.lease_id, gen=lease.gen, token=lease.token,
                           offset=lease.offset, nbytes=lease.nbytes)
            ledger.expire(101.5)
            assert ledger.overdue == 1 and allocators[0].used == lease.size  # kept past its reserve_ttl
            try:
                ledger.publish(ref, me, now=102.0, stream_ready=True)
                raise AssertionError("a publish past the deadline was taken")
            except MmfeatError as exc:
                assert exc.code is ErrorCode.STALE
            assert ledger.live == 0 and ledger.overdue == 0 and counters.publishes == 0
            ledger.expire(103.0)
            assert allocators[0].used == lease.size and len(ledger.unwritten) == 1  # the stream may still write
            if written:
                table.ready[lease.lease_id] = lease.gen  # the stream's READY store landed
                ledger.expire(103.5)
            else:
                ledger.expire(102.0 + 10.0)  # never written: back after ack_ttl
            assert allocators[0].used == 0 and books.bytes_of(me) == 0
        assert counters.late_publishes == 2 and counters.unready_ended == 0
    finally:
        table.close()
