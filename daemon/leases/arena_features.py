"""Features producers publish in their arenas, the ledger's part: their adoption by the sweep, and the
``bind`` that gives one a key and a lifetime (a reserved lease published under no key takes a key by
a bind too). A base of Ledger (daemon/leases/ledger.py), which owns the state these methods change;
kept apart so each file reads as one subject.

A keyed or retained feature is placed in its producer's arena and published by the table store like
any other; one message on the producer's fd channel, which the put does not wait for, then binds its
key and lifetime. Until that bind arrives a retained feature is *awaiting* it: the table's CONSUMERS
word (2**32 - 1, which no count of acks reaches) keeps readers' acks from ending it, no key finds it,
and nothing evicts it. It ends with its session (whose fd channel delivers every bind sent before its
end first: one still missing then was never sent, and the put that stored the feature never returned
its descriptor) or after ack_ttl.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.lease_table import ACK_COUNT_MASK
from mmfeat.protos.messages import LeaseRef

from .allocator import align_up
from .arenas import Arena
from .keys import checked_descriptor
from .lease import END_CODE, EndReason, Lease, LeaseState

_ACKED = END_CODE[EndReason.ACKED]


class ArenaFeatures:
    # The ledger's state these methods use (Ledger sets them; named here, not imported: it imports this).
    keys: Any
    arenas: Any
    counters: Any
    allocators: Any
    gens: Any
    gate: Any
    epoch: int
    ack_ttl: float
    live: int
    _ended: Any
    _table: Any
    _deadlines: Any
    _quick_observers: Any
    _go_live: Any
    _account: Any
    _producers_lease: Any
    _free: Any

    def adopt(self, arena: Arena, slot_id: int, gen: int, nbytes: int, offset: int, consumers: int, token: bytes,
              now: float) -> Lease:
        """A feature its producer published in its arena: PUBLISHED from here, acked and expired like any.
        ``consumers`` 2**32 - 1: a retained feature, awaiting its bind (which counts no consumers)."""
        alloc = self.allocators[arena.pool_id]
        awaiting = consumers == ACK_COUNT_MASK
        counted = 0 if awaiting else consumers
        lease = Lease(
            lease_id=slot_id,
            gen=gen,
            pool_id=arena.pool_id,
            offset=offset,
            nbytes=nbytes,
            token=token,
            consumers=counted,
            remaining=counted,
            state=LeaseState.PUBLISHED,
            session=arena.session,
            deadline=now + self.ack_ttl,
            reserved_at=now,
            published_at=now,
            size=align_up(nbytes, alloc.alignment),
            arena=arena,
            awaiting_bind=awaiting,
        )
        self._go_live(lease)
        self.live += 1
        self._account(lease, +1)
        self.arenas.feature_added(arena, slot_id, offset, lease.size)
        self._deadlines.push(lease)
        self.counters.publishes += 1
        self.counters.arena_publishes += 1
        self.counters.arena_adoptions += 1
        return lease

    def adopt_acked(self, slots: np.ndarray, gens: np.ndarray, consumers: np.ndarray, acks: np.ndarray) -> None:
        """Features their producers published and all their consumers acked between two sweeps (the
        sweep checked every word against the arenas, and that a GPU-pool feature's READY word is
        written): counted as published, acked and freed without ever becoming live leases (no Lease, no
        expiry entry, no arena bookkeeping, so nothing keeps their range once the arena goes back).
        Arrays, one element per feature: slot, generation, consumers expected, acks counted."""
        self.gens[slots] = gens
        self.gate[slots] = gens
        self._ended[slots] = _ACKED
        if self._table is not None:
            self._table.free_many(slots, gens, ready=False)
        n, expected, counted = len(slots), int(consumers.sum()), int(acks.sum())
        c = self.counters
        c.publishes += n
        c.arena_publishes += n
        c.acks += expected
        c.over_acks += counted - expected
        c.table_acks += counted
        c.frees += n
        for observe in self._quick_observers:
            observe(n)

    def bind(self, ref: LeaseRef, session: bytes, now: float, key: Optional[str], retain_ttl: Optional[float],
             descriptor: Optional[bytes]) -> tuple[Lease, Optional[bytes]]:
        """Bind ``key`` and ``retain_ttl`` to the feature ``session`` published in its arena that ``ref``
        names (the sweep adopted it), or ``key`` alone to a lease it reserved under no key and published:
        the lease, and the descriptor a lookup of the key answers (another
        feature's where the key named a live one already: the key keeps naming that one, and this
        feature stays, unkeyed, for its own lifetime; None without a key). Every check comes before
        anything changes: a refused bind leaves the feature as it was."""
        if key is None and retain_ttl is None:
            raise MmfeatError(ErrorCode.BAD_REQUEST, "bind: give a key, a retain_ttl, or both")
        if key is None and descriptor is not None:
            raise MmfeatError(ErrorCode.BAD_REQUEST, "bind: a descriptor is kept for lookups by key; bind without "
                              "a key takes none")
        lease = self._producers_lease(ref, session, "bind")
        if lease.bound or lease.key is not None:
            raise MmfeatError(ErrorCode.BAD_STATE, f"lease {lease.lease_id} was bound already; bind once")
        if lease.arena is None:
            # A reserved lease: its lifetime was set at reserve, and its key may follow its publish.
            if lease.hold_of is not None or lease.state is not LeaseState.PUBLISHED:
                raise MmfeatError(ErrorCode.BAD_STATE, f"lease {lease.lease_id} is a hold, or not published yet: "
                                  "bind a reserved lease's key after its publish (or reserve it with its key)")
            if retain_ttl is not None:
                raise MmfeatError(ErrorCode.BAD_REQUEST, f"lease {lease.lease_id} is a reserved one: its lifetime "
                                  "was set at reserve; bind its key alone")
        elif (retain_ttl is not None) != lease.awaiting_bind:
            raise MmfeatError(ErrorCode.BAD_REQUEST, f"lease {lease.lease_id} was published with CONSUMERS "
                              f"{ACK_COUNT_MASK if lease.awaiting_bind else lease.consumers}: a retained feature is "
                              f"published with {ACK_COUNT_MASK} and bound with a retain_ttl, a counted one with its "
                              "count and bound without")
        if now >= lease.deadline and lease.retain_ttl is None:
            # Its ack_ttl passed before the bind came, whether or not the timer has ended it yet.
            self.counters.expired += 1
            self._free(lease, EndReason.EXPIRED_PUBLISHED, now)
            raise MmfeatError(ErrorCode.STALE, f"lease {lease.lease_id} waited past its ack_ttl for this bind and "
                              "ended; put it again")
        if key is not None:
            descriptor = checked_descriptor(descriptor, lease, self.epoch)
        lease.bound = True
        self.counters.binds += 1
        if lease.awaiting_bind:
            lease.awaiting_bind = False
            lease.retain_ttl = retain_ttl
            lease.deadline = lease.published_at + retain_ttl  # as a reserved one's: from its publish
            self.keys.retained(lease)
            self._deadlines.push(lease)
        if key is None:
            return lease, None
        live = self.keys.find(key)
        if live is not None:
            # The key's first feature stays its; this one's descriptor, which its producer has, stays readable.
            self.counters.dedups += 1
            self.keys.count(key, "dedups")
            return lease, live.descriptor
        assert descriptor is not None
        self.keys.bind(lease, key, descriptor)
        return lease, descriptor

