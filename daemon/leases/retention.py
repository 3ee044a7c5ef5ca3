"""Keys and lifetimes, the ledger's part: holds on retained features, eviction by key and under
pressure, and the end of a dead holder's holds. A base of Ledger (daemon/leases/ledger.py), which
owns the state these methods change; kept apart so each file reads as one subject.

A hold is a lease of its own over a retained feature's bytes: a slot, a generation and a token, with
``consumers`` the readers it protects. Its readers get and ack it as any feature (one compare-and-swap
in the lease table, or a message); its end (their acks, its ack_ttl, its holder's session) is the
ledger's usual free, which here gives back only the slot and then looks whether the feature it held
may go now. While any hold lives, nothing frees the feature: an eviction by key or a release only
unbinds its key (``doomed``), and its retain_ttl waits.

A pin is a hold without a message: reads added to the retained feature's own ACKS word by whoever
found its descriptor (the key feed), released there by the readers' acks (protos/lease_table.py). The
daemon learns of pins by sweeping, and closes the word before it frees the feature: pins outstanding
make the free wait as a hold does, for at most ``ack_ttl`` after the daemon saw them (pins name no
session, so a dead pinner's are waited for that long).
"""

from __future__ import annotations

import secrets
from typing import Any, Optional

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.lease_table import (
    ACK_COUNT_MASK, ACK_GEN_MASK, ACKS, PIN_CLOSED, PIN_MAX, PIN_RELEASED_SHIFT, PUBLISHED, ack_word, pins,
)
from mmfeat.protos.messages import TOKEN_BYTES

from .allocator import align_up
from .lease import EndReason, Lease, LeaseState


class Retention:
    # The ledger's state these methods use (Ledger sets them; named here, not imported: it imports this).
    keys: Any
    books: Any
    counters: Any
    space: Any
    gens: Any
    allocators: Any
    gpu_pools: frozenset[int]
    live: int
    max_leases: int
    holds_live: int
    pinned: dict[int, Lease]
    ack_ttl: float
    _leases: dict[int, Lease]
    _table: Any
    _deadlines: Any

    def hold(self, base: Lease, session: bytes, count: int, now: float) -> Lease:
        """A hold on retained feature ``base`` for ``count`` readers: a lease of its own (slot, generation,
        token) over the feature's bytes, which its readers get and ack as any feature; while it lives,
        nothing frees ``base``. It ends at ``count`` acks, after ack_ttl, or with ``session``."""
        if base.retain_ttl is None:
            raise MmfeatError(ErrorCode.BAD_STATE, f"lease {base.lease_id} is counted: its consumer count protects "
                              "its readers. Holds are for retained features (put them with retain_ttl)")
        if base.hold_of is not None:
            raise MmfeatError(ErrorCode.BAD_STATE, "that descriptor is a hold: hold the feature itself (its key)")
        if base.state is not LeaseState.PUBLISHED or base.doomed is not None:
            raise MmfeatError(ErrorCode.NOT_FOUND, f"lease {base.lease_id} is not published, or was evicted")
        # Whatever refuses it is found before anything is evicted, as for a reserve (make_room).
        own = not self.books.admits_single(session, 0)
        if own and not self._own_eviction_admits(session, 0, keep=base):
            try:
                self.books.check_single(session)
            except MmfeatError:
                self.counters.over_quota += 1
                raise
        short = self.live >= self.max_leases or not self.space.has_single
        if short and self._no_room_after_evictions(None, 0, keep=base) is not None:
            self.counters.pool_full += 1
            raise MmfeatError(ErrorCode.POOL_FULL, "every lease slot is in use (max_leases), by no retained feature "
                              "that could be evicted: no room for a hold; ack holds sooner, or raise max_leases")
        if own:
            self.evict_own(session, 0, now, keep=base)
        if short:
            self.evict_for(None, 0, now, keep=base)
        slot = self.space.take() if self.live < self.max_leases else None
        if slot is None:
            self.counters.pool_full += 1
            raise MmfeatError(ErrorCode.POOL_FULL, "every lease slot is in use (max_leases): no room for a hold; "
                              "ack holds sooner, or raise max_leases")
        hold = Lease(lease_id=slot, gen=int(self.gens[slot]) + 1, pool_id=base.pool_id, offset=base.offset,
                     nbytes=base.nbytes, token=secrets.token_bytes(TOKEN_BYTES), consumers=count, remaining=count,
                     state=LeaseState.PUBLISHED, session=session, deadline=now + self.ack_ttl, reserved_at=now,
                     published_at=now, hold_of=base)
        self._go_live(hold)
        self.live += 1
        self.holds_live += 1
        if self._table is not None:
            self._table.set_live(slot, hold.gen, PUBLISHED, hold.pool_id, hold.offset, hold.nbytes, count, hold.token)
        self.books.hold_taken(session, slot)
        self._deadlines.push(hold)
        base.holds += 1
        self.counters.holds += 1
        self.keys.count(base.key, "holds")
        return hold

    def renew(self, lease: Lease, until: float) -> None:
        """Move live ``lease``'s deadline to ``until`` where that is later (a pulled copy, handed out
        again, lives on past its last handout as a feature does past its publish)."""
        if until > lease.deadline:
            lease.deadline = until
            self._deadlines.push(lease)

    def pins_seen(self, lease: Lease, word: int, now: float) -> None:
        """A sweep read retained feature ``lease``'s ACKS word changed to ``word``: note its pins, fold a
        settled word back to zero, and free it if it was only waiting for its pins."""
        if word >> 32 != lease.gen & ACK_GEN_MASK:
            return  # not this generation's word (a peer of the group rewrote it): nothing to apply
        taken, released, closed = pins(word & ACK_COUNT_MASK)
        if closed:
            return
        self._note_pins(lease, taken, released, now)
        if lease.pins:
            return
        if taken and self._table is not None and not lease.pins_frozen:
            # Room for the next pins; a pin or release that lands first fails this swap, and the next
            # sweep reads it.
            if self._table.cas(lease.lease_id, ACKS, word, ack_word(lease.gen))[0]:
                self._table.seen_acks[lease.lease_id] = ack_word(lease.gen)
                lease.pins_taken = 0
        if lease.doomed is not None and not lease.holds:
            self._free(lease, lease.doomed, now)

    def _note_pins(self, lease: Lease, taken: int, released: int, now: float) -> None:
        if lease.pins_frozen:
            # No pin lands on a filled word: a changed ``taken`` is a peer's rewrite, which must not move
            # the end of the wait (SPEC.md, section 9: client bytes pin a feature ack_ttl at most).
            lease.pins = max(0, taken - released)
            return
        if taken != lease.pins_taken:
            if taken > lease.pins_taken:
                self.counters.table_pins += taken - lease.pins_taken
            lease.pins_taken, lease.pinned_at = taken, now
        lease.pins = max(0, taken - released)
        if lease.pins:
            self.pinned[lease.lease_id] = lease
        else:
            self.pinned.pop(lease.lease_id, None)

    def close_pins(self, lease: Lease, now: float) -> bool:
        """Close retained feature ``lease``'s ACKS word to new pins, so that it may be freed: True once
        closed, False (the word left open) while pins are outstanding and ``ack_ttl`` has not passed
        since the daemon first saw their count. The swap decides against a pin landing at the same time."""
        table = self._table
        if table is None or lease.retain_ttl is None:
            return True
        slot, gen = lease.lease_id, lease.gen
        closed_word = ack_word(gen, PIN_CLOSED)
        word = table.load(slot, ACKS)
        for _ in range(8):  # bounded: a peer rewriting the word without end does not hold the daemon
            if word >> 32 == gen & ACK_GEN_MASK:
                taken, released, closed = pins(word & ACK_COUNT_MASK)
                if closed:
                    return True
                self._note_pins(lease, taken, released, now)
                if lease.pins and now < lease.pinned_at + self.ack_ttl:
                    return False
            ok, word = table.cas(slot, ACKS, word, closed_word)
            if ok:
                self.counters.pins_forgiven += lease.pins  # their readers' acks never came within ack_ttl
                lease.pins = 0
                self.pinned.pop(slot, None)
                break
        table.seen_acks[slot] = closed_word
        return True

    def wait_for_pins(self, lease: Lease, reason: EndReason, now: float) -> None:
        """``lease`` was to end for ``reason`` but pins are outstanding: no key finds it from now on, and
        it is freed once they are released (the sweep) or at ``ack_ttl`` after they were seen (expiry)."""
        lease.doomed = reason
        self.keys.unbind(lease)
        self.keys.not_retained(lease)
        self._freeze_pins(lease, now)
        lease.deadline = lease.pinned_at + self.ack_ttl
        self._deadlines.push(lease)

    def _freeze_pins(self, lease: Lease, now: float) -> None:
        """Fill waiting ``lease``'s word: ``taken`` to PIN_MAX and ``released`` raised by as much, so that
        the pins outstanding stay what they were, their releases still land, and no new pin does (it
        would pass PIN_MAX): the wait ends ack_ttl after the pins the daemon saw up to here, and a word
        a peer keeps rewriting no longer moves that (``_note_pins``)."""
        table = self._table
        if table is None or lease.pins_frozen:
            return
        slot, gen = lease.lease_id, lease.gen
        word = table.load(slot, ACKS)
        for _ in range(8):  # bounded: a peer rewriting the word without end does not hold the daemon
            if word >> 32 != gen & ACK_GEN_MASK:
                break
            taken, released, closed = pins(word & ACK_COUNT_MASK)
            if closed:
                break
            self._note_pins(lease, taken, released, now)
            up = PIN_MAX - taken
            if released > taken:
                break  # a peer's word: nothing outstanding (the next close swaps it)
            filled = ack_word(gen, PIN_MAX | (released + up) << PIN_RELEASED_SHIFT)
            ok, word = table.cas(slot, ACKS, word, filled)
            if ok:
                table.seen_acks[slot] = filled
                lease.pins_taken = PIN_MAX
                break
        # Frozen even where a peer's rewrites kept the swap from landing: only such a peer pins it now.
        lease.pins_frozen = True

    def _hold_ended(self, base: Lease, now: float) -> None:
        base.holds -= 1
        if base.holds or self._leases.get(base.lease_id) is not base:
            return
        if base.doomed is not None:
            self._free(base, base.doomed, now)
        elif now >= base.deadline:
            self.counters.retained_expired += 1
            self.keys.count(base.key, "expired")
            self._free(base, EndReason.RETAIN_EXPIRED, now)

    def end_holds(self, session: bytes, now: float) -> int:
        """End the holds of a session that ended: a dead holder's readers are not waited for."""
        slots = self.books.holds_of(session)
        for slot in slots:
            lease = self._leases.get(slot)
            if lease is not None and lease.hold_of is not None:
                self.counters.holds_reclaimed += 1
                self._free(lease, EndReason.HOLDER_GONE, now)
        return len(slots)

    def evict(self, key: str, now: float) -> tuple[bool, bool]:
        """Unbind ``key``: (a feature was live under it, its bytes stay for its readers a while). A retained
        feature is freed (once its holds end); a counted one stays for its consumers' acks, unfindable."""
        lease = self.keys.find(key)
        if lease is None:
            return False, False
        self.counters.evicted_by_key += 1
        self.keys.count(key, "evictions")
        if lease.retain_ttl is None:
            self.keys.unbind(lease)
            return True, True
        self._free(lease, EndReason.EVICTED_BY_KEY, now)
        return True, lease.doomed is not None  # held or pinned: its bytes stay for their readers

    def evict_for(self, pool_id: Optional[int], nbytes: int, now: float, keep: Optional[Lease] = None) -> int:
        """Free retained features nothing holds, oldest first, until a reserve of ``nbytes`` in pool
        ``pool_id`` (None: a hold, which needs a slot only) would fit; the number freed."""
        n = 0
        for lease in self.keys.evictable():
            if pool_id is None:
                if self.live < self.max_leases and self.space.has_single:
                    break
            elif self.fits(pool_id, nbytes):
                break
            if lease is keep:
                continue
            short_of_slots = self.live >= self.max_leases or not self.space.has_single
            if short_of_slots or pool_id is None:
                if lease.arena is not None:
                    continue  # its slot is its arena's, never a single one
            elif lease.pool_id != pool_id or not _range_goes_back(lease):
                continue  # its range would not help this pool
            self.counters.evictions += 1
            self.keys.count(lease.key, "evictions")
            self._free(lease, EndReason.EVICTED, now)
            n += 1
        return n

    def evict_own(self, session: bytes, size: int, now: float, keep: Optional[Lease] = None) -> int:
        """Free ``session``'s own retained features nothing holds, oldest first, until its quota admits a
        lease of ``size`` bytes; the number freed. Retained features are a cache: the producer's own
        cache must not turn its next put inline, as the pool's need for space does not."""
        if self.books.quota_bytes and size > self.books.quota_bytes:
            return 0  # no eviction makes room for it: its refusal says so
        n = 0
        for lease in self.keys.evictable():
            if self.books.admits_single(session, size):
                break
            if lease.session != session or lease is keep:
                continue
            if lease.arena is not None and (not lease.arena.returned or self.books.short_of_singles(session)):
                continue  # what it would give back counts for nothing in this quota
            self.counters.evictions += 1
            self.keys.count(lease.key, "evictions")
            self._free(lease, EndReason.EVICTED, now)
            n += 1
        return n

    def make_room(self, session: bytes, pool_id: int, nbytes: int, now: float, quota: bool) -> None:
        """Evict what a reserve of ``nbytes`` in pool ``pool_id`` needs evicted: the session's own retained
        features nothing holds for its quota (``quota``), then any session's for the pool's range or a
        slot. Where evicting all it may would still not do, raise OVER_QUOTA or POOL_FULL having evicted
        nothing: a refused reserve must not have emptied other sessions' caches for nothing."""
        alloc = self.allocators[pool_id]
        size = align_up(nbytes, alloc.alignment)
        own = quota and not self.books.admits_single(session, size)
        if own and not self._own_eviction_admits(session, size):
            self.books.admit_single(session, size)  # raises OVER_QUOTA, counted
        short = not self.fits(pool_id, nbytes)
        if short:
            why = self._no_room_after_evictions(pool_id, nbytes)
            if why is not None:
                self.counters.pool_full += 1
                raise MmfeatError(ErrorCode.POOL_FULL, why)
        if own:
            self.evict_own(session, size, now)
        if short and not self.fits(pool_id, nbytes):
            self.evict_for(pool_id, nbytes, now)

    def _own_eviction_admits(self, session: bytes, size: int, keep: Optional[Lease] = None) -> bool:
        """Whether the session's quota would admit one more single lease of ``size`` bytes once every
        retained feature of its own that nothing holds were evicted (evict_own evicts only as many as
        that takes)."""
        own = [lease for lease in self.keys.evictable() if lease.session == session and lease is not keep]
        return self.books.admits_single(session, size, sum(lease.size for lease in own if _range_goes_back(lease)),
                                        sum(1 for lease in own if lease.arena is None))

    def _no_room_after_evictions(self, pool_id: Optional[int], nbytes: int,
                                 keep: Optional[Lease] = None) -> Optional[str]:
        """None if evicting the retained features nothing holds (evict_for) would make room for a reserve
        of ``nbytes`` in pool ``pool_id`` (None: a hold, which needs a slot only); else why not."""
        evictable = [lease for lease in self.keys.evictable() if lease is not keep]
        singles = sum(1 for lease in evictable if lease.arena is None)  # an arena's slots are never single ones
        if self.live - singles >= self.max_leases or not (self.space.has_single or singles):
            return (f"every lease slot is in use ({self.live} leases live, max_leases {self.max_leases}, arenas "
                    "included) and evicting the retained features nothing holds would not free one; retry or "
                    "fall back to inline")
        if pool_id is None:
            return None
        alloc = self.allocators[pool_id]
        table = self._table
        # A GPU feature whose READY word is behind gives its range back only later (unwritten.py).
        ranges = [(lease.offset, lease.size) for lease in evictable if lease.pool_id == pool_id
                  and _range_goes_back(lease) and not (pool_id in self.gpu_pools and table is not None
                           and not table.is_ready(lease.lease_id, lease.gen))]
        if alloc.largest_after(ranges) >= align_up(nbytes, alloc.alignment):
            return None
        return (f"pool {pool_id} has no free range of {nbytes} B (free {alloc.free} B, largest {alloc.largest_free} "
                "B), even with every retained feature nothing holds evicted; fall back to inline or wait for acks")


def _range_goes_back(lease: Lease) -> bool:
    """Whether freeing ``lease`` gives its range back to the pool (and its bytes to its session's quota):
    not while it lies in an arena its producer still places features in, where the range is the
    producer's ring's (a producer returns an arena whose ring a retained feature blocks, SPEC.md,
    section 5, and from then on its features are evicted as any)."""
    return lease.arena is None or lease.arena.returned
