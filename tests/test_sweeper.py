"""The sweep's timing rules, on the daemon's own table, ledger and sweeper in this process: the
clock is passed in, so what a sweep leaves for the next one is checked exactly, with no sleeps."""

from __future__ import annotations

import math
import mmap
import struct

import pytest

from mmfeat import atomics
from mmfeat.daemon.leases.allocator import Allocator
from mmfeat.daemon.leases.arenas import Arenas
from mmfeat.daemon.leases.counters import Counters
from mmfeat.daemon.leases.lease_table import LeaseTable
from mmfeat.daemon.leases.ledger import Ledger
from mmfeat.daemon.leases.session_books import SessionBooks
from mmfeat.daemon.leases.slots import SlotSpace
from mmfeat.daemon.leases.sweeper import Sweeper
from mmfeat.protos.lease_table import (
    ACKS, CONSUMERS, DONE, FREE, NBYTES, OFFSET, POOL, PUBLISHED, STATE, TOKEN, ack_word, state_word, table_bytes,
    word_offset,
)

pytestmark = pytest.mark.skipif(not atomics.AVAILABLE, reason="libatomic not found: no arenas, no sweeps of them")

SLOTS = 64
ACK_TTL = 2.0
_U64 = struct.Struct("<Q")


class Books:
    """A ledger with one arena of 16 slots, and the table mapped a second time, as its producer maps it."""

    def __init__(self) -> None:
        self.table = LeaseTable(SLOTS, 7)
        self.counters = Counters()
        self.quick: list[int] = []  # what the ledger tells a QuickObserver (metrics): features ended in a batch
        allocators, space = {0: Allocator(1 << 24)}, SlotSpace(SLOTS, 16)
        books = SessionBooks(self.counters)
        self.arenas = Arenas(allocators, space, self.counters, books, 1 << 20, 4)
        self.ledger = Ledger(allocators, 7, self.counters, 5.0, ACK_TTL, space, self.arenas, books, (), self.table,
                             [self.quick.append])
        self.sweeper = Sweeper(self.table, self.ledger)
        self.arena = self.arenas.grant(b"s" * 16, 0)
        self.mm = mmap.mmap(self.table.fd, table_bytes(SLOTS), flags=mmap.MAP_SHARED)

    def write(self, slot: int, word: int, value: int) -> None:
        _U64.pack_into(self.mm, word_offset(SLOTS, slot, word), value)

    def publish(self, k: int, gen: int = 1) -> int:
        """Feature k of the arena (4 KiB at 4 KiB * k, one consumer, generation ``gen``); its slot."""
        slot = self.arena.slot_base + k
        for word, value in ((ACKS, ack_word(gen)), (POOL, 0), (OFFSET, self.arena.offset + 4096 * k), (NBYTES, 4096),
                            (CONSUMERS, 1), (TOKEN, 1), (TOKEN + 1, 2)):
            self.write(slot, word, value)
        self.write(slot, STATE, state_word(gen, PUBLISHED))
        return slot

    def ack(self, slot: int) -> None:
        """Its one consumer's ack, and the DONE that the last ack writes."""
        self.write(slot, ACKS, ack_word(1, 1))
        self.write(slot, STATE, state_word(1, DONE))

    def close(self) -> None:
        self.mm.close()
        self.table.close()


@pytest.fixture
def books():
    b = Books()
    yield b
    b.close()


def test_timer_sweeps_leave_an_unacked_publish_up_to_their_limit_with_its_ttl_from_the_first(books) -> None:
    slot = books.publish(0)
    limit = books.sweeper.defer_limit()
    assert 0 < limit <= ACK_TTL / 4
    books.sweeper.sweep(10.0, defer_unacked=True)
    assert books.ledger.live == 0 and books.ledger.live_lease(slot) is None  # left for a later sweep
    books.sweeper.sweep(10.0 + limit / 2, defer_unacked=True)
    assert books.ledger.live == 0  # left again, still within the limit
    books.sweeper.sweep(10.0 + limit, defer_unacked=True)
    lease = books.ledger.live_lease(slot)
    assert lease is not None and lease.deadline == 10.0 + ACK_TTL  # counted from the first sweep that saw it
    assert books.ledger.expire(10.0 + ACK_TTL + 0.01) == 1 and books.ledger.live == 0


def test_a_publish_acked_before_the_next_sweep_ends_in_its_batch_never_adopted(books) -> None:
    slot = books.publish(1)
    books.sweeper.sweep(20.0, defer_unacked=True)
    books.ack(slot)
    books.sweeper.sweep(20.05, defer_unacked=True)
    assert books.ledger.live == 0 and books.counters.frees == 1 and books.counters.arena_publishes == 1
    assert books.counters.bad_table_words == 0 and books.quick == [1]  # ended in the batch, never a live lease


def test_sweeps_before_a_reply_adopt_at_once(books) -> None:
    slot = books.publish(2)
    books.sweeper.sweep(30.0)
    assert books.ledger.live == 1 and books.ledger.live_lease(slot).deadline == 30.0 + ACK_TTL
    # And a timer sweep's leftover is adopted by the next sweep of either kind, as of the first sighting.
    other = books.publish(3)
    books.sweeper.sweep(31.0, defer_unacked=True)
    assert books.ledger.live_lease(other) is None
    books.sweeper.sweep(31.1)
    assert books.ledger.live == 2 and books.ledger.live_lease(other).deadline == 31.0 + ACK_TTL


def test_a_burst_put_ahead_of_its_consumer_ends_in_one_batch_never_adopted_one_by_one(books) -> None:
    """A producer puts every slot of its arena before its consumer reads any (a tokenizer's burst);
    timer sweeps come and go meanwhile, then the consumer acks them all. Each feature then costs the
    daemon its share of array operations: none becomes a live lease (a Python pass to adopt, another
    to end), and the sweeps that only look again at features still waiting count no new words, so
    they do not pull the sweep interval in while the burst waits."""
    slots = [books.publish(k) for k in range(16)]
    applied = [books.sweeper.sweep(50.0 + 0.01 * i, defer_unacked=True) for i in range(10)]
    assert books.ledger.live == 0 and books.counters.publishes == 0
    assert applied[0] == 16 and applied[1:] == [0] * 9
    for slot in slots:
        books.ack(slot)
    books.sweeper.sweep(50.2, defer_unacked=True)
    assert books.quick == [16] and books.ledger.live == 0 and books.counters.frees == 16
    assert books.counters.arena_publishes == 16 and books.counters.bad_table_words == 0


def test_a_refused_word_put_back_never_erases_a_publish_made_meanwhile(books) -> None:
    """A peer writes FREE with generation 0 over a slot the daemon freed; the sweep refuses it and puts
    its own word back. If the slot's producer publishes in between (it read FREE, and goes above its own
    last generation), putting the word back with a plain store erased that feature: its consumer then
    got STALE (seen once in CI, test_table_attacks). The producer's publish is made to land there, the
    moment the sweep judges the refused word, by running it from the ledger's lookup of the slot."""
    slot = books.publish(4)
    books.ack(slot)
    books.sweeper.sweep(40.0)
    assert books.ledger.live == 0 and books.counters.frees == 1  # the daemon wrote FREE, generation 1
    books.write(slot, STATE, state_word(0, FREE))  # the peer
    live_lease, armed = books.ledger.live_lease, [True]

    def publish_while_judged(s: int):
        if s == slot and armed:
            armed.clear()
            books.publish(4, gen=2)  # the producer, between the sweep's read of the column and its judgement
        return live_lease(s)

    books.ledger.live_lease = publish_while_judged
    books.sweeper.sweep(41.0)
    assert not armed and books.counters.bad_table_words == 1  # the peer's word was judged and refused
    books.sweeper.sweep(41.1)
    lease = books.ledger.live_lease(slot)
    assert lease is not None and lease.gen == 2, "the publish made while the peer's word was judged was erased"



def test_the_loop_wakes_at_the_earliest_live_deadline_and_no_other(books) -> None:
    """The loop sleeps until ``next_deadline()``, so a TTL expires on time whatever its tick. A feature
    acked before its deadline leaves its entry in the expiry heap; ``next_deadline()`` drops such
    entries, or a stream of features acked early would wake the loop once for each."""
    assert books.ledger.next_deadline() == math.inf
    first = books.publish(4)
    books.sweeper.sweep(40.0)
    second = books.publish(5)
    books.sweeper.sweep(41.0)
    assert books.ledger.next_deadline() == 40.0 + ACK_TTL
    books.ack(first)
    books.sweeper.sweep(41.5)
    assert books.ledger.live == 1 and books.ledger.timers == 2  # the acked one's entry is still there
    assert books.ledger.next_deadline() == 41.0 + ACK_TTL
    books.ack(second)
    books.sweeper.sweep(41.6)
    assert books.ledger.next_deadline() == math.inf and books.ledger.timers == 0


def test_a_spent_generation_never_erases_a_publish_made_meanwhile(books) -> None:
    """A peer publishes garbage in a free slot; the sweep spends that generation and writes FREE with
    it. If the peer rewrote the word FREE just after the sweep read it, the slot's producer may have
    published there (above the spent generation) before the sweep's store, and a plain store erased
    that feature. The producer's publish is made to land the moment the sweep spends the generation."""
    slot = books.publish(6)
    books.ack(slot)
    books.sweeper.sweep(50.0)
    assert books.counters.frees == 1  # FREE with generation 1
    books.write(slot, POOL, 9)  # the peer: another pool's feature, generation 2
    books.write(slot, STATE, state_word(2, PUBLISHED))
    end_generation, armed = books.ledger.end_generation, [True]

    def publish_while_spent(s: int, gen: int) -> None:
        end_generation(s, gen)
        if s == slot and armed:
            armed.clear()
            books.publish(6, gen=3)  # the producer, after the peer's FREE and before the sweep's store

    books.ledger.end_generation = publish_while_spent
    books.sweeper.sweep(51.0)
    assert not armed and books.counters.bad_table_words == 1  # the peer's generation was spent
    books.sweeper.sweep(51.1)
    lease = books.ledger.live_lease(slot)
    assert lease is not None and lease.gen == 3, "the publish made while a generation was spent was erased"


def test_a_request_sweeps_what_its_reply_needs_never_other_sessions_words() -> None:
    """A member writes words the daemon refuses into slots its session holds. Another session's reserve,
    publish, lookup and ack, handled by the daemon's own handlers and table, sweep the slots those
    replies depend on only: the member's words stay unread (not put back, not counted). The loop's
    timer sweep, which reads the whole table, still finds and refuses every one."""
    import os

    from mmfeat.daemon import handlers
    from mmfeat.daemon.config import Settings
    from mmfeat.daemon.core import DaemonCore
    from mmfeat.daemon.leases.sessions import PeerCred
    from mmfeat.daemon.pools.host import HostPool
    from mmfeat.protos import messages as m

    core = DaemonCore(Settings(max_leases=SLOTS), [HostPool(0, 1 << 24)])
    mm = mmap.mmap(core.table.fd, table_bytes(SLOTS), flags=mmap.MAP_SHARED)
    try:
        tokens = []
        for name in ("member", "honest"):
            token = handlers.hello(core, m.HelloRequest(name=name, pid=os.getpid()), 1.0).session
            core.sessions.attach(token, PeerCred(os.getpid(), os.getuid(), os.getgid()))
            tokens.append(token)
        member, honest = tokens
        refs = [handlers.reserve(core, m.ReserveRequest(session=member, nbytes=4096, consumers=1), 1.0).lease
                for _ in range(20)]
        # No producer may publish in a reserved lease's slot: each word is refused, once a sweep reads it.
        forged = [(ref.lease, state_word(ref.gen + 5, PUBLISHED)) for ref in refs]
        for slot, word in forged:
            _U64.pack_into(mm, word_offset(SLOTS, slot, STATE), word)

        def unread() -> bool:
            return all(_U64.unpack_from(mm, word_offset(SLOTS, s, STATE))[0] == w for s, w in forged)

        reply = handlers.reserve(core, m.ReserveRequest(session=honest, nbytes=4096, consumers=1), 2.0)
        ref = m.LeaseRef(**{k: getattr(reply.lease, k) for k in ("pool", "epoch", "lease", "gen", "token", "offset",
                                                                    "nbytes")})
        handlers.publish(core, m.PublishRequest(session=honest, lease=ref), 2.0)
        handlers.lookup(core, m.LookupRequest(lease=ref), 2.0)
        assert handlers.ack(core, m.AckRequest(lease=ref, count=1), 2.0).freed
        assert core.counters.bad_table_words == 0 and unread(), "a request swept another session's words"
        core.sweep(3.0, defer_unacked=True)  # the loop's timer sweep
        assert core.counters.bad_table_words == len(forged) and not unread()
    finally:
        mm.close()
        core.close()


def test_an_arena_grant_with_room_sweeps_nothing() -> None:
    """A producer ahead of its consumers asks for an arena every few dozen features: a grant the session
    and the pool have room for reads no table word (a sweep of the session's blocks each time was most of
    what such a burst cost the daemon). Words its session wrote meanwhile are still read by later sweeps,
    which is what may cut it."""
    import os

    from mmfeat.daemon import handlers
    from mmfeat.daemon.config import Settings
    from mmfeat.daemon.core import DaemonCore
    from mmfeat.daemon.leases.sessions import PeerCred
    from mmfeat.daemon.pools.host import HostPool
    from mmfeat.protos import messages as m

    core = DaemonCore(Settings(max_leases=4 * SLOTS, arena_slots=16, arenas_per_session=3, arena_mb=1),
                      [HostPool(0, 1 << 25)])
    mm = mmap.mmap(core.table.fd, table_bytes(4 * SLOTS), flags=mmap.MAP_SHARED)
    try:
        token = handlers.hello(core, m.HelloRequest(name="producer", pid=os.getpid()), 1.0).session
        core.sessions.attach(token, PeerCred(os.getpid(), os.getuid(), os.getgid()))
        first = handlers.arena(core, m.ArenaRequest(session=token), 1.0).arena
        forged = state_word(99, PUBLISHED)  # refused once read: outside the arena's range
        _U64.pack_into(mm, word_offset(4 * SLOTS, first.slot_base, OFFSET), 1 << 40)
        _U64.pack_into(mm, word_offset(4 * SLOTS, first.slot_base, STATE), forged)
        sweeps = core.counters.sweeps
        handlers.arena(core, m.ArenaRequest(session=token), 2.0)
        assert core.counters.sweeps == sweeps, "an arena grant with room swept the table"
        assert _U64.unpack_from(mm, word_offset(4 * SLOTS, first.slot_base, STATE))[0] == forged
        handlers.arena(core, m.ArenaRequest(session=token), 2.0)
        with pytest.raises(Exception):  # the session's limit: the grant short of room sweeps, then refuses
            handlers.arena(core, m.ArenaRequest(session=token), 2.0)
        assert core.counters.sweeps == sweeps + 1
        core.sweep(3.0)  # as stats sweeps: nothing left for later
        assert core.counters.bad_table_words == 1
    finally:
        mm.close()
        core.close()
