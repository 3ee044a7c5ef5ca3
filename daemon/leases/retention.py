"""Keys and lifetimes, the ledger's part: holds on retained features, eviction by key and under
pressure, and the end of a dead holder's holds. A base of Ledger (daemon/leases/ledger.py), which
owns the state these methods change; kept apart so each file reads as one subject.

A hold is a lease of its own over a retained feature's bytes: a slot, a generation and a token, with
``consumers`` the readers it protects. Its readers get and ack it as any feature (one compare-and-swap
in the lease table, or a message); its end (their acks, its ack_ttl, its holder's session) is the
ledger's usual free, which here gives back only the slot and then looks whether the feature it held
may go now. While any hold lives, nothing frees the feature: an eviction by key or a release only
unbinds its key (``doomed``), and its retain_ttl waits.
"""

from __future__ import annotations

import secrets
from typing import Any, Optional

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.lease_table import PUBLISHED
from mmfeat.protos.messages import TOKEN_BYTES

from .lease import EndReason, Lease, LeaseState


class Retention:
    # The ledger's state these methods use (Ledger sets them; named here, not imported: it imports this).
    keys: Any
    books: Any
    counters: Any
    space: Any
    gens: Any
    live: int
    max_leases: int
    holds_live: int
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
        if not self.books.admits_single(session, 0):
            self.evict_own(session, 0, now, keep=base)
        try:
            self.books.check_single(session)
        except MmfeatError:
            self.counters.over_quota += 1
            raise
        if self.live >= self.max_leases or not self.space.has_single:
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
        held = lease.holds > 0
        self._free(lease, EndReason.EVICTED_BY_KEY, now)
        return True, held

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
            if pool_id is not None and lease.pool_id != pool_id and not short_of_slots:
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
            self.counters.evictions += 1
            self.keys.count(lease.key, "evictions")
            self._free(lease, EndReason.EVICTED, now)
            n += 1
        return n
