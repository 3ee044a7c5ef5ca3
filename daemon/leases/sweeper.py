"""The sweep: read what clients wrote into the lease table since the last one and apply it.

Producers publish features of their arenas by writing an entry's STATE word; consumers ack by adding
to its ACKS word. Neither sends a message, so the daemon looks: numpy compares both columns against
what it last accounted for (``LeaseTable.seen_*``), over the two dense slot ranges in use. Features
published and acked by all since the last sweep, the common case under load, are checked and ended as
one batch of array operations (``_end_acked``); only the other changed slots reach Python one by one.

Every word read here was written by a client and is untrusted (SPEC.md, section 9): it is checked
against the daemon's own records (the arena that owns the slot, the generation it last saw, the
arena's range) before it changes anything, and a refused word is counted and put back.

What one session can make a sweep do is bounded. Words in slots nobody holds (no live lease, no arena
taking features) are refused or applied as arrays, never one by one: only the daemon writes those
slots, so a plain store puts a word back there. A word refused in a slot a session holds is charged
to that session (``charge``); a session past its limit has its words skipped for the rest of the sweep,
and the daemon cuts it once the sweep is over (``take_over``), which frees its slots.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np

from mmfeat.atomics import fence_acquire
from mmfeat.protos.descriptor import LEASE_ALIGNMENT
from mmfeat.protos.lease_table import (
    ACK_COUNT_MASK, ACK_GEN_MASK, ACKS, CONSUMERS, DONE, FREE, NBYTES, OFFSET, PIN_CLOSED, POOL, PUBLISHED, STATE,
    ack_word, state_word,
)
from mmfeat.protos.messages import MAX_CONSUMERS

from .arenas import BLOCK_OFFSET, BLOCK_POOL, BLOCK_SIZE, Arena
from .lease_table import LeaseTable
from .lease import EndReason, Lease, LeaseState
from .ledger import LIVE_GATE, Ledger

log = logging.getLogger("mmfeatd.sweep")

_WARN_EVERY_S = 10.0
# The longest a timer sweep leaves a feature published in an arena and not yet acked (see sweep): a
# consumer reading a burst that its producer put ahead of it acks within seconds, a busy machine's too.
DEFER_MAX_S = 60.0
_CAS_TRIES = 8
_BEHIND = np.uint64(1 << 63)
_PIN_CLOSED = np.uint64(PIN_CLOSED)  # a READY word this far or more below a generation has not reached it (is_ready)


def _distinct(slots: np.ndarray) -> np.ndarray:
    """``slots`` sorted, each once (as np.unique, which imports numpy.ma on its first call: tens of
    milliseconds inside the first request that sweeps by slot)."""
    slots = np.sort(slots)
    if len(slots) > 1:
        slots = slots[np.concatenate(([True], slots[1:] != slots[:-1]))]
    return slots


class Sweeper:
    def __init__(self, table: LeaseTable, ledger: Ledger) -> None:
        self.table = table
        self.ledger = ledger
        # Called with the session a refused word is charged to; True once that session is past its limit.
        self.charge: Callable[[bytes], bool] = lambda session: False
        self._over: set[bytes] = set()  # sessions past their limit: cut after this sweep
        self._last_unheld_warning = float("-inf")
        self._last_warning = float("-inf")
        self._settled: set[int] = set()  # slots this sweep ended out of order (DONE), not to apply again
        self._found = False  # whether this sweep found a word changed
        # Fresh publishes timer sweeps left for later ones, per slot: the STATE word (0: none) and when a
        # sweep first saw it. Arrays, so that a burst of features waiting for their consumers costs each
        # later sweep array operations, not a Python step per feature.
        self._defer_word = np.zeros(table.slots, dtype=np.uint64)
        self._defer_at = np.zeros(table.slots, dtype=np.float64)

    def sweep(self, now: float, defer_unacked: bool = False, slots: Optional[np.ndarray] = None) -> int:
        """Apply every publish and ack clients wrote since the last sweep; the number of words applied.

        ``slots`` (an array of slot numbers) sweeps those alone, of the ranges in use: a request sweeps
        what its reply depends on, not other sessions' words. The rest of the table keeps what it holds,
        and what timer sweeps left there stays left, for the next sweep that reads it.

        With ``defer_unacked`` (the loop's timer sweeps), a feature published in an arena and not yet
        acked by all is left for later sweeps, for up to ``defer_limit()`` seconds from the first that
        saw it: one of them usually finds it acked and ends it in its batch, where adopting it as a live
        lease and ending it later cost a cache-cold Python pass each, for a feature that is being read.
        A producer ahead of its consumers (a burst of hundreds) is the case this pays most in. A feature
        still unacked at the limit is adopted as of when it was first seen, so its ``ack_ttl`` runs from
        then all the same. Sweeps before a reply (stats, lookup, ...) adopt everything: what they answer
        stays exact.

        A sweep that finds no word changed in what it reads counts in ``sweeps_skipped``, any other in
        ``sweeps``."""
        self._settled = set()
        self._found = False
        ranges = self.ledger.space.ranges()
        if slots is None:
            parts: list = [slice(lo, hi) for lo, hi in ranges]
        else:
            slots = _distinct(np.asarray(slots, dtype=np.int64))
            inside = np.zeros(len(slots), dtype=bool)
            for lo, hi in ranges:
                inside |= (slots >= lo) & (slots < hi)
            parts = [slots[inside]] if inside.any() else []
        applied = sum(self._sweep_part(part, now, defer_unacked) for part in parts)
        counters = self.ledger.counters
        if self._found:
            counters.sweeps += 1
        else:
            counters.sweeps_skipped += 1
        return applied

    def sweep_held(self, changed: list[tuple[int, int, int]], now: float) -> Optional[int]:
        """A request's sweep of a few slots, word by word, where each slot whose words changed holds a live
        feature: ``changed`` lists those slots (in slot order, each once) with their ACKS and STATE words
        as read (LeaseTable.changed); the number of words applied. None, having done nothing, where one
        of them holds no live feature: ``sweep`` judges those.

        In slots that hold live features the array steps of ``_sweep_part`` find nothing to do (no word
        is refused as unheld, none ends in the batch, none is left for a later sweep), so what is left
        is its steps one by one, in its order: each changed STATE word, then each changed ACKS word."""
        ledger, seen_state, seen_acks = self.ledger, self.table.seen_state, self.table.seen_acks
        if any(ledger.live_lease(slot) is None for slot, _, _ in changed):
            return None
        ledger.counters.sweeps += 1
        settled = self._settled = set()
        published = [(slot, state) for slot, _, state in changed if state != seen_state[slot]]
        for slot, state in published:
            published_at = float(self._defer_at[slot]) if self._defer_word[slot] == state else now
            self._defer_word[slot] = 0
            if slot in settled or (self._over and self._owner(slot) in self._over):
                continue
            self._on_state(slot, state, now, published_at)
        moved = settled.union(slot for slot, _ in published)
        stale = [(slot, acks) for slot, acks, _ in changed if slot not in moved and acks != seen_acks[slot]]
        live = [ledger.live_lease(slot) is not None for slot, _ in stale]
        for (slot, acks), held in zip(stale, live):
            # An ACKS word of a slot no longer live changes no lease (_on_acks counts it as _stray_acks does).
            if not (held and self._over and self._owner(slot) in self._over):
                self._on_acks(slot, acks, now)
        return len(published) + len(stale)

    def _sweep_part(self, part, now: float, defer_unacked: bool) -> int:
        """Sweep ``part`` of the table: a slice of slots, or an array of slot numbers."""
        table = self.table
        settled = self._settled
        defer_word, defer_at, limit = self._defer_word, self._defer_at, self.defer_limit()
        # ACKS before STATE: an ack seen here was written after its feature's publish (the consumer
        # had the descriptor), so the STATE read after it sees that publish too.
        acks = table.acks[part].copy()
        fence_acquire()
        states = table.states[part].copy()
        fence_acquire()
        # Nothing written in the range (a server's idle client): two memcmps instead of the ten
        # array calls below, each of which is slow when the caches are cold.
        if (states.tobytes() == table.seen_state[part].tobytes()
                and acks.tobytes() == table.seen_acks[part].tobytes()):
            return 0
        self._found = True
        ids = np.arange(part.start, part.stop) if isinstance(part, slice) else part  # index -> slot
        changed = 0
        published = np.flatnonzero(states != table.seen_state[part])
        rest = self._end_acked(ids, self._refuse_unheld(ids, published, states), states)
        slots, words = ids[rest], states[rest]
        # When a sweep first saw each word: an earlier one that left it, or this one.
        again = defer_word[slots] == words
        first_seen = np.where(again, defer_at[slots], now)
        defer_word[ids[published]] = 0  # each is ended in the batch, refused, handled below, or left again
        if defer_unacked and len(rest):
            # Left again: a fresh publish (no live lease in its slot) within the limit. seen_state
            # keeps its old word, so the next sweep looks again; its words are not new ones.
            keep = ((words & 3 == PUBLISHED) & (self.ledger.gate[slots] != LIVE_GATE)
                    & (now - first_seen < limit))
            defer_word[slots[keep]], defer_at[slots[keep]] = words[keep], first_seen[keep]
            changed -= int((keep & again).sum())
            rest, slots, first_seen = rest[~keep], slots[~keep], first_seen[~keep]
        for i, slot, published_at in zip(rest.tolist(), slots.tolist(), first_seen.tolist()):
            if slot in settled or (self._over and self._owner(slot) in self._over):
                continue  # an over-limit session's word waits for the cut, which frees its slot
            self._on_state(slot, int(states[i]), now, published_at)
        # After the publishes, whose handling read their ACKS words afresh: this sweep's older copy
        # of those is skipped (the next sweep compares them again), and of those settled early too.
        stale = acks != table.seen_acks[part]
        stale[published] = False
        if settled:
            stale[np.isin(ids, np.fromiter(settled, dtype=np.int64, count=len(settled)))] = False
        changed_acks = np.flatnonzero(stale)
        live = self.ledger.gate[ids[changed_acks]] == LIVE_GATE
        self._stray_acks(ids[changed_acks[~live]], acks[changed_acks[~live]])
        for i in changed_acks[live].tolist():
            slot = int(ids[i])
            if not (self._over and self._owner(slot) in self._over):
                self._on_acks(slot, int(acks[i]), now)
        return changed + len(published) + int(stale.sum())

    def defer_limit(self) -> float:
        """How long timer sweeps leave an unacked publish: DEFER_MAX_S, and well inside ``ack_ttl`` (which
        a reload may shorten), so that adopting it late never makes its expiry late."""
        return min(DEFER_MAX_S, self.ledger.ack_ttl / 4)

    def take_over(self) -> set[bytes]:
        """The sessions that went past their limit of refused words; forgotten here."""
        over, self._over = self._over, set()
        return over

    def _owner(self, slot: int) -> Optional[bytes]:
        """The session that holds ``slot``: its live lease's, or its arena's."""
        lease = self.ledger.live_lease(slot)
        if lease is not None:
            return lease.session
        arena = self.ledger.arenas.of_slot(slot)
        return arena.session if arena is not None else None

    def _refuse_unheld(self, ids: np.ndarray, changed: np.ndarray, states: np.ndarray) -> np.ndarray:
        """Put back, as one batch, the changed STATE words (indices into ``ids``, the slots swept) of slots nobody
        holds: no live lease there, and no arena that takes features. Only the daemon writes those (a
        consumer's DONE needs a live feature, a producer's publish an arena it holds), so every such word
        is refused and a plain store is enough. The indices left, of held slots, for the checks."""
        if not len(changed):
            return changed
        ledger = self.ledger
        slots = ids[changed]
        unheld = ledger.unheld(slots)
        if not unheld.any():
            return changed
        refused = slots[unheld]
        self.table.restore_states(refused)
        n = len(refused)
        ledger.counters.bad_table_words += n
        now = time.monotonic()
        if now - self._last_unheld_warning >= _WARN_EVERY_S:
            self._last_unheld_warning = now
            log.warning("STATE of %d slot(s) no session holds changed (slot %d first, to %#x); put back (%d refused "
                        "so far; SPEC.md section 9)", n, int(refused[0]), int(states[changed[unheld][0]]),
                        ledger.counters.bad_table_words)
        return changed[~unheld]

    def _stray_acks(self, slots: np.ndarray, words: np.ndarray) -> None:
        """ACKS words changed in slots with no live lease, as one batch: nothing to apply them to. An
        increase of the same generation's count is an over-ack after the feature ended (counted)."""
        if not len(slots):
            return
        seen = self.table.seen_acks[slots]
        # A word the daemon closed (a retained feature's pins) is its own store, not an ack.
        up = ((words >> 32) == (seen >> 32)) & (words > seen) & (words & _PIN_CLOSED == 0)
        self.ledger.counters.stray_table_acks += int(((words[up] & ACK_COUNT_MASK) - (seen[up] & ACK_COUNT_MASK)).sum())
        self.table.seen_acks[slots] = words

    def _end_acked(self, ids: np.ndarray, changed: np.ndarray, states: np.ndarray) -> np.ndarray:
        """End, as one batch, the features among ``changed`` (indices into ``ids``, the slots swept) that their
        producers published and all their consumers acked since the last sweep; the indices left for
        ``_on_state``. Each is checked as ``_on_state`` would: a slot of an arena that takes features,
        no live lease in it, a new generation, its entry inside the arena, its ack word naming that
        generation with every consumer's ack, and in a GPU pool its READY word written. Whatever fails a
        check is left for ``_on_state``, which refuses it, adopts it (acks still missing), or adopts and
        ends it (READY behind)."""
        if not len(changed):
            return changed
        ledger, table = self.ledger, self.table
        slots = ids[changed]
        words = states[changed]
        gens = words >> 2
        arena = ledger.arenas.blocks[slots // ledger.space.block]
        entry = table.entries[slots]
        acks = table.acks[slots]
        fence_acquire()  # these loads before the FREE stores that hand the slots back
        pool, offset, nbytes, consumers = (entry[:, word - POOL] for word in (POOL, OFFSET, NBYTES, CONSUMERS))
        # Inside the arena in unsigned arithmetic: at or past its start (``rel`` wraps below it), and
        # 1 to ``size - rel`` bytes. A returned arena's size reads 0 here, as a block no arena holds.
        rel, size = offset - arena[:, BLOCK_OFFSET], arena[:, BLOCK_SIZE]
        good = ((words & 3 >= PUBLISHED) & (gens > ledger.gate[slots]) & (pool == arena[:, BLOCK_POOL])
                & (offset % LEASE_ALIGNMENT == 0) & (rel <= size) & (nbytes - 1 < size - rel)
                & (consumers - 1 < MAX_CONSUMERS)
                & (acks >> 32 == gens & ACK_GEN_MASK) & (acks & ACK_COUNT_MASK >= consumers))
        if ledger.gpu_pools and good.any():
            # A GPU-pool feature whose READY word is behind its generation was acked before its producer's
            # GPU wrote it (a cancelled read, an ack without after=): its copy may still be queued. Left
            # for _on_state, which ends it as a lease, so that its range and slot stay out of the pool
            # until the word is written (unwritten.py), whatever becomes of its arena meanwhile.
            behind = table.ready[slots] - gens >= _BEHIND  # READY - g mod 2^64, negative as signed
            in_gpu = np.zeros(len(slots), dtype=bool)
            for pool_id in ledger.gpu_pools:
                in_gpu |= pool == pool_id
            good &= ~(behind & in_gpu)
        if not good.any():
            return changed
        ended, acks = slots[good], acks[good]
        table.seen_acks[ended] = acks
        ledger.adopt_acked(ended, gens[good], consumers[good], acks & ACK_COUNT_MASK)
        return changed[~good]

    def _on_state(self, slot: int, word: int, now: float, published_at: float) -> None:
        ledger = self.ledger
        gen, state = word >> 2, word & 3
        lease = ledger.live_lease(slot)
        if lease is not None and state == DONE and gen == lease.gen and lease.state is LeaseState.PUBLISHED:
            if lease.retain_ttl is not None or lease.awaiting_bind:
                # No count of acks reaches a retained feature's: a peer of the group wrote that DONE.
                self._refuse(slot, word, lease.session, f"slot {slot} holds a retained feature, which no ack "
                             "ends, and was marked DONE")
                return
            self._on_done(slot, lease, now)  # its last consumer acked: the common end of a live feature
            return
        arena = ledger.arenas.of_slot(slot)
        owner = lease.session if lease is not None else arena.session if arena is not None else None
        if arena is None or arena.returned:
            # Slots of reserved leases and of free blocks are the daemon's alone (but for DONE, above).
            self._refuse(slot, word, owner, f"STATE of slot {slot} changed, but no producer holds that slot")
            return
        if lease is not None or state not in (PUBLISHED, DONE) or gen <= ledger.slot_gen(slot):
            self._refuse(slot, word, owner, f"STATE of slot {slot} went to generation {gen} state {state}; a producer "
                         f"may only publish a generation above {ledger.slot_gen(slot)} in a slot it got back FREE")
            return
        # Not ended by _end_acked: a feature waiting for acks, one acked before its GPU wrote it, or words
        # it refused.
        pool, offset, nbytes, consumers, tok0, tok1 = self.table.entry(slot)
        acked = state == DONE and self._all_acked(slot, gen, consumers)
        # CONSUMERS 2**32 - 1: a retained feature awaiting its bind, which no ack ends (never DONE).
        retained = consumers == ACK_COUNT_MASK and state == PUBLISHED
        valid = ((state == PUBLISHED or acked) and pool == arena.pool_id and not offset % LEASE_ALIGNMENT
                 and nbytes >= 1 and (1 <= consumers <= MAX_CONSUMERS or retained))
        if valid and not arena.fits(offset, nbytes):
            # Its producer may reuse the space of features whose last consumer marked them DONE before
            # this daemon has ended them: end those first.
            self._settle(arena, offset, nbytes, now)
        if not valid or not arena.fits(offset, nbytes):
            # The generation is spent (the producer believes it published it); the feature is not.
            ledger.end_generation(slot, gen)
            # With a compare-and-swap, as _refuse puts words back: a peer that rewrote the word FREE
            # since this sweep read it lets the slot's producer publish there, and that stays.
            spent = state_word(gen, FREE)
            self.table.ready[slot] = gen  # as before every FREE: a stream waiting on it goes on
            if self.table.cas(slot, STATE, word, spent)[0]:
                self.table.seen_state[slot] = spent
            self._count_bad(arena.session, f"slot {slot} was published with pool {pool}, range [{offset}, +{nbytes}), "
                            f"{consumers} consumers and state {state}: not inside arena {arena.arena_id} "
                            f"[{arena.offset}, +{arena.size}) of pool {arena.pool_id}, over a live feature, or DONE "
                            "without its acks; refused")
            return
        # Acks that arrived since _end_acked read the word are applied by the next sweep.
        self.table.seen_state[slot] = word
        self._reset_acks(slot, gen, arena.session)
        token = tok0.to_bytes(8, "little") + tok1.to_bytes(8, "little")
        lease = ledger.adopt(arena, slot, gen, nbytes, offset, consumers, token, published_at)
        if acked:
            # Every consumer acked it, but its READY word is behind (_end_acked left it): it ends as a
            # lease, which keeps its range and slot until its GPU has written it.
            self._on_done(slot, lease, now)

    def _all_acked(self, slot: int, gen: int, consumers: int) -> bool:
        """Whether the slot's ACKS word names generation ``gen`` with at least ``consumers`` acks."""
        acks = self.table.load(slot, ACKS)
        return acks >> 32 == gen & ACK_GEN_MASK and acks & ACK_COUNT_MASK >= consumers

    def _on_done(self, slot: int, lease: Lease, now: float) -> None:
        """A live feature's last consumer marked it DONE: apply its acks, which end it."""
        self._settled.add(slot)
        self._on_acks(slot, self.table.load(slot, ACKS), now)
        if self.ledger.live_lease(slot) is lease:
            # Marked DONE without all its acks (a peer of the group can write STATE; SPEC.md section 9).
            # Its producer may be writing over it already: it ends here all the same.
            self._count_bad(lease.session, f"slot {slot} was marked DONE with {lease.remaining} of its "
                            f"{lease.consumers} acks missing; ended")
            self.ledger.end(lease, EndReason.ACKED, now)

    def _settle(self, arena: Arena, offset: int, nbytes: int, now: float) -> None:
        """End the live features under [offset, +nbytes) whose STATE is DONE now (it may have been
        PUBLISHED still when this sweep copied the column, before the producer saw DONE and reused)."""
        for slot in arena.overlapping(offset, nbytes):
            lease = self.ledger.live_lease(slot)
            if lease is not None and self.table.load(slot, STATE) == state_word(lease.gen, DONE):
                self._on_done(slot, lease, now)
        # And the ended features kept for their READY word (unwritten.py): the producer's ring reuses
        # such space once the word is written, which may be before the loop's tick gives it back.
        self.ledger.unwritten.settle(now)

    def _reset_acks(self, slot: int, gen: int, owner: bytes) -> None:
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
        self._count_bad(owner, f"slot {slot} was published without resetting its ack word")

    def _on_acks(self, slot: int, word: int, now: float) -> None:
        seen = int(self.table.seen_acks[slot])
        self.table.seen_acks[slot] = word
        lease = self.ledger.live_lease(slot)
        gen = lease.gen & ACK_GEN_MASK if lease is not None else None
        if gen is None or word >> 32 != gen:
            # An over-ack after the feature ended, or the old generation's word read before its producer
            # reset it for the next one: nothing live to apply it to.
            if lease is None and word >> 32 == seen >> 32 and word > seen and not word & PIN_CLOSED:
                self.ledger.counters.stray_table_acks += (word & ACK_COUNT_MASK) - (seen & ACK_COUNT_MASK)
            return
        if lease.retain_ttl is not None and lease.state is LeaseState.PUBLISHED and not lease.awaiting_bind:
            self.ledger.pins_seen(lease, word, now)  # a retained feature's word counts pins, not acks
            return
        before = seen & ACK_COUNT_MASK if seen >> 32 == gen else 0
        count = (word & ACK_COUNT_MASK) - before
        if count == 0:
            return  # the baseline, seen after an older generation's word
        if count < 0:
            self._count_bad(lease.session, f"the ack count of slot {slot} went down, from {before} to "
                            f"{word & ACK_COUNT_MASK}")
            return
        self.ledger.counters.table_acks += count
        self.ledger.apply_acks(lease, count, now)

    def _refuse(self, slot: int, word: int, owner: Optional[bytes], message: str) -> None:
        """Put the daemon's STATE word back over the refused ``word``, unless the slot holds another word
        by now: its producer may have published there since this sweep read the refused one (a peer
        rewrote a FREE slot's generation just before), and a plain store would erase that feature.
        The next sweep judges whatever is there."""
        self.table.cas(slot, STATE, word, int(self.table.seen_state[slot]))
        self._count_bad(owner, message)

    def _count_bad(self, owner: Optional[bytes], message: str) -> None:
        """Count a refused word, charged to ``owner``, the session that holds its slot (None: nobody)."""
        self.ledger.counters.bad_table_words += 1
        if owner is not None and owner not in self._over and self.charge(owner):
            self._over.add(owner)
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning("%s (%d refused so far; SPEC.md section 9)", message, self.ledger.counters.bad_table_words)
