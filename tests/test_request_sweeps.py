"""A request sweeps the lease table only once a word its reply depends on changed: lookups, holds and
pings of features nobody writes read a few words and sweep nothing, and any word a client writes (an
ack, a DONE, a publish, a forged word, a rewritten header) still makes the next request that depends on
it sweep and answer from it. First on the daemon's own core in this process, word by word, then against
a real daemon with producers, readers and a scheduler in processes of their own."""

from __future__ import annotations

import mmap
import os
import struct
from typing import Iterator

import pytest
import torch

from mmfeat import atomics
from mmfeat.client import Client, Namespace
from mmfeat.protos.lease_table import (
    ACKS, CONSUMERS, DONE, NBYTES, OFFSET, POOL, PUBLISHED, STATE, TOKEN, ack_word, state_word, table_bytes,
    word_offset,
)

from . import key_workers

pytestmark = pytest.mark.skipif(not atomics.AVAILABLE, reason="libatomic not found: no arenas, no table acks")

SLOTS = 256
_U64 = struct.Struct("<Q")
NS = Namespace(framework="test", version="1", model="quiet-sweeps", dtype="float32")


class Core:
    """The daemon's core, handlers and table in this process, with the table mapped a second time as a
    client maps it, and one attached session."""

    def __init__(self) -> None:
        from mmfeat.daemon import handlers
        from mmfeat.daemon.config import Settings
        from mmfeat.daemon.core import DaemonCore
        from mmfeat.daemon.leases.sessions import PeerCred
        from mmfeat.daemon.pools.host import HostPool
        from mmfeat.protos import messages as m

        self.h, self.m = handlers, m
        self.core = DaemonCore(Settings(max_leases=SLOTS, arena_slots=16, arena_mb=1), [HostPool(0, 1 << 25)])
        self.mm = mmap.mmap(self.core.table.fd, table_bytes(SLOTS), flags=mmap.MAP_SHARED)
        self.token = handlers.hello(self.core, m.HelloRequest(name="producer", pid=os.getpid()), 1.0).session
        self.core.sessions.attach(self.token, PeerCred(os.getpid(), os.getuid(), os.getgid()))

    def published(self, consumers: int = 2, retain_ttl: float | None = None):
        """A reserved lease, published: its LeaseRef."""
        m = self.m
        reply = self.h.reserve(self.core, m.ReserveRequest(session=self.token, nbytes=4096, consumers=consumers,
                                                           retain_ttl=retain_ttl), 1.0)
        ref = m.LeaseRef(**{k: getattr(reply.lease, k) for k in ("pool", "epoch", "lease", "gen", "token", "offset",
                                                                  "nbytes")})
        self.h.publish(self.core, m.PublishRequest(session=self.token, lease=ref), 1.0)
        return ref

    def write(self, slot: int, word: int, value: int) -> None:
        _U64.pack_into(self.mm, word_offset(SLOTS, slot, word), value)

    def read(self, slot: int, word: int) -> int:
        return _U64.unpack_from(self.mm, word_offset(SLOTS, slot, word))[0]

    def swept(self, **request) -> bool:
        """Whether a request's sweep of ``slots`` / ``blocks`` swept (True) or was skipped (False)."""
        c = self.core.counters
        before = (c.sweeps, c.sweeps_skipped)
        self.core.sweep(5.0, **request)
        ran, skipped = c.sweeps - before[0], c.sweeps_skipped - before[1]
        assert ran + skipped == 1, (ran, skipped)
        return ran == 1

    def close(self) -> None:
        self.mm.close()
        self.core.close()


@pytest.fixture
def core() -> Iterator[Core]:
    c = Core()
    yield c
    c.close()


def test_a_request_sweeps_its_slots_once_a_word_there_changed_and_never_misses_one(core) -> None:
    """Over one slot, over more slots than are compared one by one, and over an arena's block: nothing
    written, no sweep; each kind of word a client writes there makes the next one sweep and apply it."""
    refs = [core.published() for _ in range(40)]
    counters = core.core.counters
    one = dict(slots=(refs[3].lease,))
    many = dict(slots=[r.lease for r in refs])
    for request in (one, many):
        assert not core.swept(**request)
    # A consumer's ack (one of two): applied by the sweep it makes happen.
    core.write(refs[3].lease, ACKS, ack_word(refs[3].gen, 1))
    acks = counters.table_acks
    assert core.swept(**one) and counters.table_acks == acks + 1
    assert not core.swept(**one) and not core.swept(**many)
    # A forged STATE in a live feature's slot: read and refused (put back).
    forged = state_word(refs[20].gen + 5, PUBLISHED)
    core.write(refs[20].lease, STATE, forged)
    bad = counters.bad_table_words
    assert not core.swept(**one), "another slot's word made this request sweep"
    assert core.swept(**many) and counters.bad_table_words == bad + 1
    assert core.read(refs[20].lease, STATE) == state_word(refs[20].gen, PUBLISHED)
    # Its last consumer's ack and DONE: the feature ends.
    core.write(refs[5].lease, ACKS, ack_word(refs[5].gen, 2))
    core.write(refs[5].lease, STATE, state_word(refs[5].gen, DONE))
    assert core.swept(**many) and core.core.ledger.live_lease(refs[5].lease) is None
    # A rewritten header: a request puts it back, though no slot of its changed.
    core.mm[:8] = b"FORGED!!"
    bad = counters.bad_table_words
    core.core.sweep(5.0, **one)
    assert counters.bad_table_words == bad + 1 and core.core.table.header_intact(False)
    # Slot numbers outside the table are nobody's: skipped, not read.
    assert not core.swept(slots=(-1, SLOTS, SLOTS + 7))

    # An arena's block: a publish there, then its consumer's ack.
    grant = core.h.arena(core.core, core.m.ArenaRequest(session=core.token), 6.0).arena
    block = dict(slots=(), blocks=[(grant.slot_base, grant.slot_base + grant.slots)])
    assert not core.swept(**block)
    slot, gen = grant.slot_base + 2, core.read(grant.slot_base + 2, STATE) // 4 + 1
    for word, value in ((ACKS, ack_word(gen)), (POOL, grant.pool), (OFFSET, grant.offset), (NBYTES, 4096),
                        (CONSUMERS, 1), (TOKEN, 1), (TOKEN + 1, 2)):
        core.write(slot, word, value)
    core.write(slot, STATE, state_word(gen, PUBLISHED))
    publishes = counters.arena_publishes
    assert core.swept(**block) and counters.arena_publishes == publishes + 1
    assert not core.swept(**block)
    core.write(slot, ACKS, ack_word(gen, 1))
    assert core.swept(**block) and core.core.ledger.live_lease(slot) is None


def test_a_hold_sweeps_its_sessions_slots_and_its_features_in_one_sweep(core) -> None:
    """A hold reads its session's slots (words there may cut it) and the held feature's (acks there may
    have ended it): one sweep reads both, and none runs while neither changed."""
    base = core.published(consumers=1, retain_ttl=300.0)
    m, counters = core.m, core.core.counters

    def hold():
        return core.h.hold(core.core, m.HoldRequest(session=core.token, lease=base, count=1), 7.0).lease

    h = hold()
    before = (counters.sweeps, counters.sweeps_skipped)
    h2 = hold()
    assert (counters.sweeps, counters.sweeps_skipped) == (before[0], before[1] + 1), "not one skipped sweep"
    # The first hold's reader acks it (and marks it DONE), and a reader pins the retained feature in
    # its own ACKS word: words in the session's slots and in the feature's.
    core.write(h.lease, ACKS, ack_word(h.gen, 1))
    core.write(h.lease, STATE, state_word(h.gen, DONE))
    core.write(base.lease, ACKS, ack_word(base.gen, 1))
    ended, pinned = counters.holds_ended, counters.table_pins
    before = (counters.sweeps, counters.sweeps_skipped)
    hold()
    assert (counters.sweeps, counters.sweeps_skipped) == (before[0] + 1, before[1])
    assert counters.holds_ended == ended + 1 and counters.table_pins == pinned + 1
    assert core.core.ledger.live_lease(h2.lease) is not None


def _held_books() -> tuple[Core, dict[str, object]]:
    """A core with counted features (two consumers each), retained ones and a hold of two readers: the
    slots of each, by name."""
    c = Core()
    slots: dict[str, object] = {f"s{i}": c.published() for i in range(6)}
    slots.update(r0=c.published(consumers=1, retain_ttl=300.0), r1=c.published(consumers=1, retain_ttl=300.0))
    slots["hold"] = c.h.hold(c.core, c.m.HoldRequest(session=c.token, lease=slots["r0"], count=2), 1.0).lease
    return c, slots


def _state_of(c: Core) -> tuple:
    """What a sweep can change: the STATE and ACKS columns, what the daemon accounted for, the live
    features, the counters (but the sweep counts) and the session's refused words."""
    table, ledger = c.core.table, c.core.ledger
    counters = {k: v for k, v in c.core.counters.as_dict().items() if k not in ("sweeps", "sweeps_skipped")}
    live = {}
    for slot in range(SLOTS):
        lease = ledger.live_lease(slot)
        if lease is not None:
            live[slot] = (lease.gen, lease.remaining, lease.state.value, lease.holds)
    return (bytes(c.mm[64: 64 + 16 * SLOTS]), table.seen_state.tobytes(), table.seen_acks.tobytes(), live, counters,
            c.core.sessions.get(c.token).refused)


def test_a_few_held_slots_swept_word_by_word_end_as_the_array_sweep_ends_them() -> None:
    """Acks, a last ack's DONE, a DONE with an ack missing, a forged STATE, acks of another generation,
    a retained feature's acks and a DONE written over it, a hold's acks: the same words in two daemons'
    tables, swept word by word in one (a request's few slots of live features) and by the array sweep
    in the other, leave the same table, books and counters; a slot that holds no live feature is left to
    the array sweep."""
    import numpy as np

    (a, slots), (b, _) = _held_books(), _held_books()
    try:
        def write(slot: str, word: int, gen_delta: int = 0, acks: int | None = None, state: int | None = None):
            ref = slots[slot]
            value = ack_word(ref.gen + gen_delta, acks) if word == ACKS else state_word(ref.gen + gen_delta, state)
            for c in (a, b):
                c.write(ref.lease, word, value)

        def sweep_both(now: float) -> None:
            picked = sorted(ref.lease for ref in slots.values())
            applied = a.core.sweeper.sweep_held(a.core.table.changed(picked), now)
            assert applied is not None, "a few slots of live features were not swept word by word"
            assert applied == b.core.sweeper.sweep(now, False, np.array(picked, dtype=np.int64))
            assert _state_of(a) == _state_of(b)

        write("s0", ACKS, acks=1)
        write("s1", ACKS, acks=2)
        write("s1", STATE, state=DONE)
        write("s2", ACKS, acks=1)
        write("s2", STATE, state=DONE)
        write("s3", ACKS, acks=1)  # read with the forged word below: left for the next sweep
        write("s3", STATE, gen_delta=5, state=PUBLISHED)
        write("s4", ACKS, gen_delta=3, acks=2)
        write("s5", ACKS, acks=2)
        write("r0", ACKS, acks=1)
        write("r1", STATE, state=DONE)
        write("hold", ACKS, acks=1)
        sweep_both(2.0)
        assert a.core.counters.bad_table_words == 3  # s2's missing ack, s3's forged word, r1's DONE
        write("s0", ACKS, acks=2)
        write("s0", STATE, state=DONE)
        write("hold", ACKS, acks=2)
        write("hold", STATE, state=DONE)
        write("r1", ACKS, acks=3)
        sweep_both(3.0)
        assert a.core.ledger.live_lease(slots["hold"].lease) is None
        # s1 ended: a word there is no live feature's, for the array sweep to judge.
        a.write(slots["s1"].lease, STATE, state_word(slots["s1"].gen + 9, PUBLISHED))
        assert a.core.sweeper.sweep_held(a.core.table.changed([slots["s1"].lease]), 4.0) is None
    finally:
        a.close()
        b.close()


def test_lookups_holds_and_pings_of_unwritten_features_sweep_nothing_against_a_daemon(daemon, children) -> None:
    """A scheduler looks retained features up, holds them and pings while nobody writes the table: the
    daemon sweeps nothing. A reader's ack in the table (another process), and a producer's publish in its
    arena, are still applied before the reply that depends on them."""
    keys = [NS.key(f"img{i}") for i in range(4)]
    q = children.Queue()
    p = children.Process(target=key_workers.keyed_producer, args=(str(daemon.runtime_dir), keys, 300.0, q))
    p.start()
    assert len(q.get(timeout=60)) == len(keys)
    p.join(30)
    assert p.exitcode == 0
    with daemon.client(map_pools=False) as scheduler:
        before = scheduler.stats()["counters"]
        for i in range(20):
            assert scheduler.has_many(keys) == [True] * len(keys)
            assert scheduler.lookup(keys[i % len(keys)]) is not None
            assert scheduler.hold(keys[i % len(keys)]) is not None
            scheduler.ping()
        after = scheduler.stats()["counters"]
        assert after["sweeps"] == before["sweeps"], "requests swept a table nobody wrote"
        assert after["sweeps_skipped"] - before["sweeps_skipped"] >= 4 * 20

        # A counted keyed feature, read and acked in the table by its one consumer in another process.
        counted = NS.key("counted")
        with daemon.client() as producer:
            producer.put(torch.ones(4096), key=counted)
        desc = scheduler.lookup(counted)
        assert desc is not None
        q = children.Queue()
        r = children.Process(target=_read_and_ack_in_table, args=(str(daemon.runtime_dir), desc.to_bytes(), q))
        r.start()
        assert q.get(timeout=60) == 4096.0
        r.join(30)
        assert scheduler.lookup(counted) is None and scheduler.has_many([counted]) == [False]
        acked = scheduler.stats()["counters"]
        assert acked["sweeps"] > after["sweeps"] and acked["table_acks"] == after["table_acks"] + 1

        # A feature its producer published in its arena, with no message: acked by message from another
        # process, whose ack's sweep (or a timer's) adopts it first.
        with daemon.client(inline_threshold=0, fallback="error") as producer:
            desc = producer.put(torch.ones(4096))
            r = children.Process(target=_ack_by_message, args=(str(daemon.runtime_dir), desc.to_bytes(), q))
            r.start()
            assert q.get(timeout=60) == (0, True)
            r.join(30)
        assert scheduler.stats()["counters"]["sweeps"] > acked["sweeps"]


def _read_and_ack_in_table(runtime_dir: str, desc: bytes, out_q) -> None:
    """A consumer: read the feature, ack it in the lease table (its last ack: DONE), report the sum."""
    c = Client(runtime_dir)
    total = float(c.get(desc, copy=True).sum())
    c.ack(desc)
    out_q.put(total)  # before close: no flush, no request that would sweep for this ack


def _ack_by_message(runtime_dir: str, desc: bytes, out_q) -> None:
    with Client(runtime_dir) as c:
        reply = c.ack(desc, wait=True)
    out_q.put((reply["remaining"], reply["freed"]))
