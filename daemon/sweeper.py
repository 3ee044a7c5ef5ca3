"""The sweep: read what clients wrote into the lease table since the last one and apply it.

Producers publish features of their arenas by writing an entry's STATE word; consumers ack by adding
to its ACKS word. Neither sends a message, so the daemon looks: numpy compares both columns against
what it last accounted for (``LeaseTable.seen_*``), over the two dense slot ranges in use, and only the
slots that differ reach Python. A sweep costs a few microseconds plus a few per changed slot.

Every word read here was written by a client and is untrusted (SPEC.md, section 9): it is checked
against the daemon's own records (the arena that owns the slot, the generation it last saw, the
arena's range) before it changes anything, and a refused word is counted and put back.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from mmfeat.atomics import fence_acquire
from mmfeat.protos.descriptor import LEASE_ALIGNMENT
from mmfeat.protos.lease_table import ACK_COUNT_MASK, ACK_GEN_MASK, ACKS, FREE, PUBLISHED, ack_word, state_word
from mmfeat.protos.messages import MAX_CONSUMERS

from .lease_table import LeaseTable
from .ledger import Ledger

log = logging.getLogger("mmfeatd.sweep")

_WARN_EVERY_S = 10.0
_CAS_TRIES = 8


class Sweeper:
    def __init__(self, table: LeaseTable, ledger: Ledger) -> None:
        self.table = table
        self.ledger = ledger
        self._last_warning = float("-inf")

    def sweep(self, now: float) -> int:
        """Apply every publish and ack clients wrote since the last sweep; the number of words applied."""
        self.ledger.counters.sweeps += 1
        table = self.table
        changed = 0
        for lo, hi in self.ledger.space.ranges():
            # ACKS before STATE: an ack seen here was written after its feature's publish (the consumer
            # had the descriptor), so the STATE read after it sees that publish too.
            acks = table.acks[lo:hi].copy()
            fence_acquire()
            states = table.states[lo:hi].copy()
            fence_acquire()
            published = np.flatnonzero(states != table.seen_state[lo:hi])
            for i in published.tolist():
                self._on_state(lo + i, int(states[i]), now)
            # After the publishes, whose handling read their ACKS words afresh: this sweep's older copy
            # of those is skipped (the next sweep compares them again).
            stale = acks != table.seen_acks[lo:hi]
            stale[published] = False
            for i in np.flatnonzero(stale).tolist():
                self._on_acks(lo + i, int(acks[i]), now)
            changed += len(published) + int(stale.sum())
        return changed

    def _on_state(self, slot: int, word: int, now: float) -> None:
        ledger, table = self.ledger, self.ledger.arenas
        arena = table.of_slot(slot)
        if arena is None or arena.returned:
            # Slots of reserved leases and of free blocks are the daemon's alone.
            self._refuse(slot, f"STATE of slot {slot} changed, but no producer holds that slot")
            return
        gen, state = word >> 2, word & 3
        if ledger.live_lease(slot) is not None or state != PUBLISHED or gen <= ledger.slot_gen(slot):
            self._refuse(slot, f"STATE of slot {slot} went to generation {gen} state {state}; a producer may only "
                         f"publish a generation above {ledger.slot_gen(slot)} in a slot it got back FREE")
            return
        pool, offset, nbytes, consumers, tok0, tok1 = self.table.entry(slot)
        if (pool != arena.pool_id or offset % LEASE_ALIGNMENT or nbytes < 1 or not arena.fits(offset, nbytes)
                or not 1 <= consumers <= MAX_CONSUMERS):
            # The generation is spent (the producer believes it published it); the feature is not.
            ledger.end_generation(slot, gen)
            self.table.store_state(slot, state_word(gen, FREE))
            self._count_bad(f"slot {slot} was published with pool {pool}, range [{offset}, +{nbytes}) and {consumers} "
                            f"consumers: not inside arena {arena.arena_id} [{arena.offset}, +{arena.size}) of pool "
                            f"{arena.pool_id}, or over a live feature; refused")
            return
        token = tok0.to_bytes(8, "little") + tok1.to_bytes(8, "little")
        acks = self.table.load(slot, ACKS)
        if acks >> 32 == gen & ACK_GEN_MASK and (acks & ACK_COUNT_MASK) >= consumers:
            # Published and acked by all since the last sweep, the common case under load: end it at once.
            self.table.seen_acks[slot] = acks
            ledger.adopt_acked(arena, slot, gen, nbytes, offset, consumers, token, acks & ACK_COUNT_MASK, now)
            return
        self.table.seen_state[slot] = word
        self._reset_acks(slot, gen)
        ledger.adopt(arena, slot, gen, nbytes, offset, consumers, token, now)

    def _reset_acks(self, slot: int, gen: int) -> None:
        """The ack baseline of a newly published generation is zero acks. The producer stored that
        before publishing; if it did not, set it here. No consumer can have added to a word that names
        another generation, so nothing counted is lost."""
        baseline = ack_word(gen)
        self.table.seen_acks[slot] = baseline
        seen = self.table.load(slot, ACKS)
        for _ in range(_CAS_TRIES):  # bounded: a peer rewriting the word without end cannot hold the loop
            if seen >> 32 == gen & ACK_GEN_MASK:
                return
            ok, seen = self.table.cas(slot, ACKS, seen, baseline)
            if ok:
                break
        self._count_bad(f"slot {slot} was published without resetting its ack word")

    def _on_acks(self, slot: int, word: int, now: float) -> None:
        seen = int(self.table.seen_acks[slot])
        self.table.seen_acks[slot] = word
        lease = self.ledger.live_lease(slot)
        gen = lease.gen & ACK_GEN_MASK if lease is not None else None
        if gen is None or word >> 32 != gen:
            # An over-ack after the feature ended, or the old generation's word read before its producer
            # reset it for the next one: nothing live to apply it to.
            if lease is None and word >> 32 == seen >> 32 and word > seen:
                self.ledger.counters.stray_table_acks += (word & ACK_COUNT_MASK) - (seen & ACK_COUNT_MASK)
            return
        before = seen & ACK_COUNT_MASK if seen >> 32 == gen else 0
        count = (word & ACK_COUNT_MASK) - before
        if count == 0:
            return  # the baseline, seen after an older generation's word
        if count < 0:
            self._count_bad(f"the ack count of slot {slot} went down, from {before} to {word & ACK_COUNT_MASK}")
            return
        self.ledger.counters.table_acks += count
        self.ledger.apply_acks(lease, count, now)

    def _refuse(self, slot: int, message: str) -> None:
        """Put the daemon's STATE word back."""
        self.table.store_state(slot, int(self.table.seen_state[slot]))
        self._count_bad(message)

    def _count_bad(self, message: str) -> None:
        self.ledger.counters.bad_table_words += 1
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning("%s (%d refused so far; SPEC.md section 9)", message, self.ledger.counters.bad_table_words)
