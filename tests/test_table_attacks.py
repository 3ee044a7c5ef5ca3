"""A peer of the allowed group writes whatever it likes into the lease table (SPEC.md, section 9): the
daemon stays up, refuses what it cannot accept, never frees a range twice or outside an arena, and its
accounting stays exact."""

from __future__ import annotations

import mmap
import os
import random
import socket
import struct
from contextlib import contextmanager
from typing import Iterator

import msgpack
import pytest
import torch

from mmfeat.protos import PROTOCOL_VERSION, ErrorCode, MmfeatError
from mmfeat.protos.lease_table import (
    ACKS, CONSUMERS, DONE, FREE, GEN_MASK, NBYTES, OFFSET, POOL, PUBLISHED, RESERVED, STATE, TOKEN, ack_word,
    state_word,
    table_bytes, word_offset,
)

_U64 = struct.Struct("<Q")


class HostileTable:
    """The table mapped writable by a session of our own, as any allowed peer can."""

    def __init__(self, daemon, client) -> None:
        hello = client.request("hello")
        self.session = hello["session"]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(str(daemon.runtime_dir / "mmfeatd.fds.sock"))
        self.sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "session": self.session}))
        _, fds, _, _ = socket.recv_fds(self.sock, 4096, 8)
        for fd in fds[:-1]:
            os.close(fd)
        self.slots = hello["table_slots"]
        self.mm = mmap.mmap(fds[-1], table_bytes(self.slots), flags=mmap.MAP_SHARED)
        os.close(fds[-1])

    def write(self, slot: int, word: int, value: int) -> None:
        _U64.pack_into(self.mm, word_offset(self.slots, slot, word), value & (2**64 - 1))

    def read(self, slot: int, word: int) -> int:
        return _U64.unpack_from(self.mm, word_offset(self.slots, slot, word))[0]

    def publish(self, slot: int, gen: int, pool: int, offset: int, nbytes: int, consumers: int = 1) -> None:
        for word, value in ((ACKS, ack_word(gen)), (POOL, pool), (OFFSET, offset), (NBYTES, nbytes),
                            (CONSUMERS, consumers), (TOKEN, 1), (TOKEN + 1, 2)):
            self.write(slot, word, value)
        self.write(slot, STATE, state_word(gen, PUBLISHED))

    def arena(self) -> dict:
        """An arena for this session, asked for on its fd channel."""
        self.sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "arena", "id": 1, "quiet": False}))
        reply = msgpack.unpackb(self.sock.recv(4096))
        assert reply["ok"], reply
        return reply["arena"]

    def arena_return(self, arena_id: int) -> None:
        self.sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "arena_return", "id": 2, "session": self.session,
                                      "arena": arena_id}))
        reply = msgpack.unpackb(self.sock.recv(4096))
        assert reply["ok"], reply

    def request(self, op: str, **fields) -> dict:
        """One request on this session's fd channel, and its reply (an error one too, as it came)."""
        self.sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "id": 3, **fields}))
        return msgpack.unpackb(self.sock.recv(4096))

    def close(self) -> None:
        self.mm.close()
        self.sock.close()


def _consistent(pool: dict) -> bool:
    a = pool["arenas"]
    return pool["used"] == sum(pool["bytes"].values()) - a["live_bytes"] + a["bytes"]


def test_forged_state_words_are_refused_and_put_back(daemon) -> None:
    with daemon.client(inline_threshold=0) as c, daemon.client() as reader:
        hostile = HostileTable(daemon, c)
        try:
            # A reserved lease lives in a slot only the daemon writes; so does a free single slot.
            ref = c.request("reserve", session=c.session.token, nbytes=4096, consumers=1)["lease"]
            # Held above it, so that the sweep still reads ref's slot once it is free.
            above = c.request("reserve", session=c.session.token, nbytes=4096, consumers=1)["lease"]
            hostile.write(ref["lease"], STATE, state_word(ref["gen"] + 5, PUBLISHED))
            s = daemon.stats()
            assert s["counters"]["bad_table_words"] == 1 and s["counters"]["arena_publishes"] == 0
            assert hostile.read(ref["lease"], STATE) == state_word(ref["gen"], 1)  # put back: RESERVED
            c.request("release", session=c.session.token, lease=ref)
            hostile.write(ref["lease"], STATE, state_word(ref["gen"] + 1, PUBLISHED))
            s = daemon.stats()
            assert (s["counters"]["bad_table_words"] == 2
                    and hostile.read(ref["lease"], STATE) == state_word(ref["gen"], 0))
            c.request("release", session=c.session.token, lease=above)

            a = hostile.arena()
            base, slot = a["offset"], a["slot_base"]
            bad = [
                (a["pool"] + 1, base, 4096, 1),  # another pool
                (a["pool"], base - 256, 4096, 1),  # before the arena
                (a["pool"], base + a["size"] - 256, 4096, 1),  # runs past its end
                (a["pool"], base + 100, 4096, 1),  # unaligned
                (a["pool"], base, 0, 1),  # empty
                (a["pool"], base, 4096, 0),  # no consumers
                (a["pool"], base, 4096, 5000),  # too many
            ]
            for k, (pool, offset, nbytes, consumers) in enumerate(bad):
                hostile.publish(slot + k, 1, pool, offset, nbytes, consumers)
            hostile.publish(slot + 10, 1, a["pool"], base, 8192)  # a good one
            daemon.stats()  # swept: adopted
            hostile.publish(slot + 11, 1, a["pool"], base + 4096, 8192)  # overlaps it
            hostile.publish(slot + 10, 0, a["pool"], base + 65536, 256)  # rewrites a live feature's slot
            s = daemon.stats()
            assert s["counters"]["arena_publishes"] == 1 and s["counters"]["bad_table_words"] == 2 + len(bad) + 2
            pool = s["pools"][0]
            assert pool["leases"]["PUBLISHED"] == 1 and pool["arenas"]["live_bytes"] == 8192 and _consistent(pool)
            # A refused generation is spent: the slot reads FREE with it, and a reader is told why.
            assert hostile.read(slot, STATE) == state_word(1, 0)
            with pytest.raises(MmfeatError) as info:
                c.request("lookup", lease={"pool": a["pool"], "epoch": s["epoch"], "lease": slot, "gen": 1,
                                           "token": bytes(16), "offset": base, "nbytes": 4096})
            assert info.value.code is ErrorCode.NOT_FOUND and "refused" in info.value.message
        finally:
            hostile.close()
        # The hostile session ended: its arena was trimmed to the one live feature, which expires or is acked.
        # (Not a client count: `reader` never connected, so two clients were there from the start.)
        s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 8192,
                            what="the hostile session to end and its arena trimmed")
        assert _consistent(s["pools"][0])
        desc_ref = {"pool": a["pool"], "epoch": s["epoch"], "lease": slot + 10, "gen": 1,
                    "token": (1).to_bytes(8, "little") + (2).to_bytes(8, "little"), "offset": base, "nbytes": 8192}
        assert reader.request("ack", lease=desc_ref)["freed"]
    assert daemon.pool()["used"] == 0


@contextmanager
def _an_adopted_feature(daemon) -> Iterator[tuple]:
    """A client, the table mapped as a hostile peer of the group maps it, and a feature of the client's
    arena for three consumers, adopted by the daemon."""
    with daemon.client(inline_threshold=0) as c:
        hostile = HostileTable(daemon, c)
        try:
            d = c.put(torch.ones(4096), consumers=3)
            daemon.stats()  # adopted
            yield c, hostile, d
        finally:
            hostile.close()


def test_forged_ack_words_are_clamped_never_a_double_free(daemon) -> None:
    with _an_adopted_feature(daemon) as (c, hostile, d):
        hostile.write(d.lease, ACKS, ack_word(d.gen, 1))
        hostile.write(d.lease, ACKS, ack_word(d.gen, 0))  # goes down between two sweeps: no change seen
        daemon.stats()
        hostile.write(d.lease, ACKS, ack_word(d.gen + 1, 7))  # another generation's word: ignored
        s = daemon.stats()
        assert s["leases"]["PUBLISHED"] == 1 and s["counters"]["acks"] == 0
        hostile.write(d.lease, ACKS, ack_word(d.gen, 2**32 - 1))  # every ack at once, and far more
        s = daemon.stats()
        assert s["counters"]["acks"] == 3 and s["counters"]["over_acks"] == 2**32 - 4 and s["counters"]["frees"] == 1
        hostile.write(d.lease, ACKS, ack_word(d.gen, 5))  # down, after the end: nothing to free twice
        s = daemon.stats()
        assert s["counters"]["frees"] == 1 and _consistent(s["pools"][0])
    assert daemon.pool()["used"] == 0


def test_a_forged_done_ends_the_feature_once_and_is_counted(daemon) -> None:
    """DONE says every consumer acked: a peer can write it early, as it can write the acks themselves.
    The daemon ends the feature (its producer may be reusing the space already), counts the word, and
    its books stay exact; a DONE without its acks in a slot nobody published is refused."""
    with _an_adopted_feature(daemon) as (c, hostile, d):
        hostile.write(d.lease, ACKS, ack_word(d.gen, 1))
        hostile.write(d.lease, STATE, state_word(d.gen, DONE))  # two acks short
        s = daemon.stats()
        assert s["leases"]["PUBLISHED"] == 0 and s["counters"]["frees"] == 1 and s["counters"]["acks"] == 1
        assert s["counters"]["bad_table_words"] == 1 and _consistent(s["pools"][0])
        assert hostile.read(d.lease, STATE) == state_word(d.gen, FREE)
        with pytest.raises(MmfeatError) as info:
            c.get(d)
        assert info.value.code is ErrorCode.NOT_FOUND
        hostile.write(d.lease, STATE, state_word(d.gen, DONE))  # again, after the end: nothing to free twice
        s = daemon.stats()
        assert s["counters"]["frees"] == 1 and hostile.read(d.lease, STATE) == state_word(d.gen, FREE)

        a = hostile.arena()
        base, slot = a["offset"], a["slot_base"]
        hostile.publish(slot, 1, a["pool"], base, 4096, consumers=2)  # published, acked and DONE unseen
        hostile.write(slot, ACKS, ack_word(1, 2))
        hostile.write(slot, STATE, state_word(1, DONE))
        hostile.publish(slot + 1, 1, a["pool"], base, 4096, consumers=2)  # the same range, DONE one ack short
        hostile.write(slot + 1, ACKS, ack_word(1, 1))
        hostile.write(slot + 1, STATE, state_word(1, DONE))
        s = daemon.stats()
        assert s["counters"]["arena_publishes"] == 2 and s["counters"]["frees"] == 2
        assert s["counters"]["bad_table_words"] == 3 and s["leases"]["PUBLISHED"] == 0
        assert hostile.read(slot + 1, STATE) == state_word(1, FREE) and _consistent(s["pools"][0])
    assert daemon.pool()["used"] == 0


@contextmanager
def _a_producer_and_its_first_slot(daemon) -> Iterator[tuple]:
    """A producer and a consumer, the table mapped as a hostile peer of the group maps it, and the first
    slot of the producer's arena (a fresh arena places its first feature in its lowest slot). Every
    feature is freed afterwards, and the arenas are back."""
    with daemon.client(inline_threshold=0) as prod, daemon.client() as cons:
        hostile = HostileTable(daemon, prod)
        try:
            first = prod.put(torch.ones(1024))
            cons.get(first)
            cons.ack(first)
            yield prod, cons, hostile, first.lease
        finally:
            hostile.close()
        assert prod.flush() and cons.flush()
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="every feature freed and the arenas back")


def _handed_over_intact(daemon, prod, cons, i: int, sweep_before_get: bool) -> None:
    t = torch.full((1024,), float(i))
    d = prod.put(t)
    if sweep_before_get:
        daemon.stats()  # the publish is adopted or refused before the consumer reads
    got = cons.get(d)
    assert torch.equal(got, t), i
    del got
    cons.ack(d)


def test_a_slot_whose_generations_a_peer_spent_is_retired_and_no_feature_is_lost(daemon) -> None:
    """A peer publishes the highest generation, with garbage, in the free slots of a producer's arena:
    the daemon refuses it, and those slots have no generation left. A wrapped generation would be
    refused too, and its feature lost to its consumer; the producer retires the slots instead."""
    with _a_producer_and_its_first_slot(daemon) as (prod, cons, hostile, base):
        for slot in range(base + 1, base + 256):
            hostile.write(slot, POOL, 999)
            hostile.write(slot, STATE, state_word(GEN_MASK, PUBLISHED))
        assert daemon.stats()["counters"]["bad_table_words"] >= 255
        for i in range(600):
            _handed_over_intact(daemon, prod, cons, i, sweep_before_get=False)


def test_a_lower_generation_written_into_free_slots_costs_no_feature(daemon) -> None:
    """A peer writes FREE with generation 0 into the free slots of a producer's arena, as if they had
    never been used. A producer that believed the word would publish a generation the daemon has seen
    already: refused at the next sweep, and lost to a consumer that reads after it. The producer goes
    above the generation it used last in the slot instead."""
    with _a_producer_and_its_first_slot(daemon) as (prod, cons, hostile, base):
        for i in range(50):
            daemon.stats()  # the daemon has written FREE for the features acked so far
            for slot in range(base, base + 256):
                if hostile.read(slot, STATE) & 3 == FREE:
                    hostile.write(slot, STATE, state_word(0, FREE))
            _handed_over_intact(daemon, prod, cons, i, sweep_before_get=True)


def test_a_lower_generation_written_into_a_reused_arena_block_costs_no_feature(daemon) -> None:
    """The same in slots the producer never used itself: its arena's block served another session's
    arena before, whose generations the daemon has seen. The producer starts from the generations the
    slots had when it received the arena."""
    with daemon.client(inline_threshold=0) as earlier, daemon.client() as cons:
        held = [earlier.put(torch.ones(1024)) for _ in range(5)]  # five slots of the block, generation 1
        for d in held:
            cons.get(d)
            cons.ack(d)
        assert earlier.flush() and cons.flush()
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the first arena back")
    with _a_producer_and_its_first_slot(daemon) as (prod, cons, hostile, base):
        assert base == held[0].lease  # the same block again
        daemon.stats()
        for slot in range(base + 1, base + 256):
            hostile.write(slot, STATE, state_word(0, FREE))
        ts = [torch.full((1024,), float(i)) for i in range(5)]
        ds = [prod.put(t) for t in ts]  # slots base+1.., which the earlier session used
        daemon.stats()  # a sweep before the consumer reads
        for t, d in zip(ts, ds):
            got = cons.get(d)
            assert torch.equal(got, t), d.lease
            del got
            cons.ack(d)


def test_features_acked_before_the_sweep_are_checked_as_a_batch_like_any_other(daemon) -> None:
    """Features published and acked by all between two sweeps are ended as one batch of array checks
    (Sweeper._end_acked). Each check must refuse what the per-slot path refuses: a batch of good and
    forged ones, written before one sweep, ends exactly the good ones and counts every forged one."""
    with daemon.client(inline_threshold=0) as c:
        hostile = HostileTable(daemon, c)
        try:
            first, a = hostile.arena(), hostile.arena()
            base, slot, pool, size = a["offset"], a["slot_base"], a["pool"], a["size"]
            assert first["offset"] + first["size"] <= base
            bad = [  # (pool, offset, nbytes, consumers, ack word): each acked by every consumer it names
                (pool + 1, base, 4096, 1, ack_word(1, 1)),  # another pool
                (pool, first["offset"], 4096, 1, ack_word(1, 1)),  # before the arena: in another one
                (pool, base + size - 256, 4096, 1, ack_word(1, 1)),  # runs past its end
                (pool, base + size, 4096, 1, ack_word(1, 1)),  # starts at its end
                (pool, 2**64 - 4096, 8192, 1, ack_word(1, 1)),  # wraps around
                (pool, base + 100, 4096, 1, ack_word(1, 1)),  # unaligned
                (pool, base, 0, 1, ack_word(1, 1)),  # empty
                (pool, base, 4096, 0, ack_word(1, 0)),  # no consumers
                (pool, base, 4096, 5000, ack_word(1, 5000)),  # too many
                (pool, base, 4096, 2, ack_word(1, 1)),  # one of its two acks
                (pool, base, 4096, 1, ack_word(2, 1)),  # acks of another generation
            ]
            good = [(pool, base + 8192 * k, 4096, k + 1, ack_word(1, k + 1 + (k == 2))) for k in range(3)]
            features = bad + good
            for k, (p, offset, nbytes, consumers, acks) in enumerate(features):
                hostile.publish(slot + k, 1, p, offset, nbytes, consumers)
                hostile.write(slot + k, ACKS, acks)
                hostile.write(slot + k, STATE, state_word(1, DONE))
            hostile.write(slot + 30, STATE, state_word(0, DONE))  # no new generation: nothing published
            for k, state in ((31, FREE), (32, RESERVED)):  # acked, but never published
                hostile.publish(slot + k, 1, pool, base + 65536 * k, 4096, 1)
                hostile.write(slot + k, ACKS, ack_word(1, 1))
                hostile.write(slot + k, STATE, state_word(1, state))
            s = daemon.stats()
            counters = s["counters"]
            assert counters["bad_table_words"] == len(bad) + 3, counters
            assert counters["arena_publishes"] == len(good) and counters["frees"] == len(good)
            assert counters["acks"] == 1 + 2 + 3 and counters["over_acks"] == 1 and counters["table_acks"] == 7
            assert s["leases"]["PUBLISHED"] == 0 and s["pools"][0]["arenas"]["live_bytes"] == 0
            assert _consistent(s["pools"][0])
            for k in range(len(features)):  # every generation spent, every slot back to its producer
                assert hostile.read(slot + k, STATE) == state_word(1, FREE), k
            # Replayed, the same words are an old generation now: refused, and nothing ends twice.
            for k in range(len(features)):
                hostile.write(slot + k, STATE, state_word(1, DONE))
            s = daemon.stats()
            assert (s["counters"]["frees"] == len(good)
                    and s["counters"]["bad_table_words"] == 2 * len(bad) + 3 + len(good))
            assert _consistent(s["pools"][0])
            # An arena given back takes no new feature, though one still lives in it.
            hostile.publish(slot + 40, 2, pool, base, 4096, consumers=1)
            daemon.stats()
            hostile.arena_return(a["id"])
            hostile.publish(slot + 41, 2, pool, base + 8192, 4096, consumers=1)
            hostile.write(slot + 41, ACKS, ack_word(2, 1))
            hostile.write(slot + 41, STATE, state_word(2, DONE))
            s = daemon.stats()
            assert s["counters"]["arena_publishes"] == len(good) + 1 and s["leases"]["PUBLISHED"] == 1
            assert s["counters"]["bad_table_words"] == 2 * len(bad) + 4 + len(good) and _consistent(s["pools"][0])
            hostile.write(slot + 40, ACKS, ack_word(2, 1))
        finally:
            hostile.close()
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the hostile session's arena to go back")


def test_a_publish_over_a_done_feature_is_accepted_whichever_slot_the_sweep_reads_first(daemon) -> None:
    """A producer reuses a feature's space once its last consumer wrote DONE, before the daemon has ended
    that feature. The sweep may reach the new publish first (a lower slot): it then ends the DONE
    features under the range before it checks the range, instead of refusing an honest publish. The
    same publish over a feature that is not DONE is still refused."""
    with daemon.client(inline_threshold=0) as c:
        hostile = HostileTable(daemon, c)
        try:
            a = hostile.arena()
            base, slot = a["offset"], a["slot_base"]
            for old, new in ((slot + 5, slot + 2), (slot + 6, slot + 9)):  # new read first, then last
                hostile.publish(old, 1, a["pool"], base, 8192, consumers=1)
                assert daemon.stats()["leases"]["PUBLISHED"] == 1  # adopted: live
                hostile.write(old, ACKS, ack_word(1, 1))
                hostile.write(old, STATE, state_word(1, DONE))
                hostile.publish(new, 1, a["pool"], base, 4096, consumers=1)  # over the DONE feature's range
                s = daemon.stats()
                assert s["counters"]["bad_table_words"] == 0, "an honest reuse of DONE space was refused"
                assert s["leases"]["PUBLISHED"] == 1 and hostile.read(old, STATE) == state_word(1, FREE)
                hostile.write(new, ACKS, ack_word(1, 1))  # the new one ends too
                daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the new feature's ack")
            hostile.publish(slot + 20, 1, a["pool"], base, 8192, consumers=1)
            daemon.stats()
            hostile.publish(slot + 3, 1, a["pool"], base, 4096, consumers=1)  # over a live, not DONE, one
            s = daemon.stats()
            assert s["counters"]["bad_table_words"] == 1 and s["leases"]["PUBLISHED"] == 1
            assert s["counters"]["frees"] == 4 and _consistent(s["pools"][0])
            hostile.write(slot + 20, ACKS, ack_word(1, 1))
        finally:
            hostile.close()
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the hostile session's arena to go back")


def test_random_words_in_the_table_leave_the_daemon_up_and_exact(daemon_factory) -> None:
    daemon = daemon_factory("--pool-mb", "128", "--ack-ttl", "2")
    rng = random.Random(7)
    with daemon.client(inline_threshold=0) as c, daemon.client() as reader:
        hostile = HostileTable(daemon, c)
        try:
            a = hostile.arena()
            live_slots = list(range(a["slot_base"], a["slot_base"] + a["slots"]))
            for rnd in range(300):
                d = c.put(torch.full((1024,), float(rnd)))
                for _ in range(20):
                    slot = rng.choice(live_slots + [d.lease, rng.randrange(hostile.slots)])
                    word = rng.randrange(8)
                    value = rng.choice([0, 1, 2, 3, rng.getrandbits(64), rng.getrandbits(32),
                                        state_word(rng.randrange(9), PUBLISHED)])
                    hostile.write(slot, word, value)
                if rnd % 3 == 0:
                    _U64.pack_into(hostile.mm, 8 * rng.randrange(8), rng.getrandbits(64))  # the header too
                try:
                    got = reader.get(d)
                    assert got.shape == (1024,)
                    reader.ack(d)
                except MmfeatError as exc:  # its words were overwritten under it: refused, never misread
                    assert exc.code in (ErrorCode.STALE, ErrorCode.NOT_FOUND, ErrorCode.FORBIDDEN), exc
                if rnd % 50 == 0:
                    assert _consistent(daemon.pool())
            s = daemon.stats()
            assert s["counters"]["bad_table_words"] > 0 and _consistent(s["pools"][0])
        finally:
            hostile.close()
    assert daemon.proc.poll() is None
    # Garbage that happened to name a valid range inside the hostile arena is a feature like any other,
    # and so is a feature whose reader refused it: they end by ack_ttl at the latest.
    s = daemon.wait_for(lambda s: s["clients"] == 0 and s["pools"][0]["used"] == 0, timeout=15,
                        what="everything to end")
    assert _consistent(s["pools"][0]) and s["counters"]["arenas_freed"] == s["counters"]["arenas_granted"]
