"""Leases: who holds which slice of which pool, in what state, until when.

A lease goes RESERVED -> PUBLISHED -> freed. It is freed when its last expected ack arrives, when the
producer releases it, when its deadline passes, or (RESERVED only) when its producer's session ends.
A feature a producer published in its arena enters PUBLISHED directly, when the sweep adopts it
(daemon/leases/arena_features.py, which also binds a key and a lifetime to one).
Lease ids index a slot table; a slot's generation grows every time it is reused, so a descriptor
that outlived its lease is told STALE instead of touching someone else's feature.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.lease_table import ACK_COUNT_MASK, FREE, PUBLISHED, RESERVED
from mmfeat.protos.messages import TOKEN_BYTES, LeaseRef

from .allocator import Allocator, align_up
from .arena_features import ArenaFeatures
from .arenas import BLOCK_SIZE, Arena, Arenas
from .counters import Counters
from .deadlines import Deadlines
from .endings import Endings
from .keys import KeyIndex, checked_descriptor, dedups
from .retention import Retention
from .lease import END_CODE, END_REASONS, EndReason, FreeObserver, Lease, LeaseState, QuickObserver
from .lease_table import LeaseTable
from .session_books import SessionBooks
from .slots import SlotSpace
from .unwritten import Unwritten


LIVE_GATE = np.iinfo(np.uint64).max  # the gate of a slot with a live lease


@dataclass(frozen=True)
class AckResult:
    remaining: int
    freed: bool
    over_acked: int
    duplicate: bool = False


class Ledger(Retention, Endings, ArenaFeatures):
    def __init__(
        self,
        allocators: dict[int, Allocator],
        epoch: int,
        counters: Counters,
        reserve_ttl: float,
        ack_ttl: float,
        space: SlotSpace,
        arenas: Arenas,
        books: SessionBooks,
        observers: Sequence[FreeObserver] = (),
        table: Optional[LeaseTable] = None,
        quick_observers: Sequence[QuickObserver] = (),
    ) -> None:
        """``space``, ``arenas`` and ``books`` are the slots, the arenas and the per-session quotas this
        ledger draws on: their owners grant arenas and set quotas; the ledger keeps them in step with
        each lease's life."""
        max_leases = space.slots
        self.allocators = allocators
        self.epoch = epoch
        self.counters = counters
        self.reserve_ttl = reserve_ttl
        self.ack_ttl = ack_ttl
        self.max_leases = max_leases
        self._observers = observers  # looked at on every free: the caller may add to it later
        self._quick_observers = quick_observers
        self._table = table
        # Pools in GPU memory, where a READY word can lag its feature's STATE (set by the core), and the
        # features there that ended before their GPU wrote them.
        self.gpu_pools: frozenset[int] = frozenset()
        self.unwritten = Unwritten(table)
        # Per slot: the generation it last gave out (0: never used) and why that one ended. Arrays, so
        # that the sweep checks and ends the features of a whole batch at once (Sweeper._end_acked).
        self.gens = np.zeros(max_leases, dtype=np.uint64)
        self._ended = np.zeros(max_leases, dtype=np.uint8)
        # What a generation published in the slot must be above: its last generation, or every value
        # while a lease is live in it.
        self.gate = np.zeros(max_leases, dtype=np.uint64)
        self._leases: dict[int, Lease] = {}  # slot -> its live lease
        self._own: dict[bytes, dict[int, Lease]] = {}  # session -> its live leases by slot (endings.py)
        self._deadlines = Deadlines(self._leases)
        self.space = space
        self.arenas = arenas
        self.books = books
        # Per pool and state: live leases and their allocated bytes, kept as they change so that stats
        # (and the metrics refresh) never walk the slot table.
        self._count = {p: {st: 0 for st in LeaseState} for p in allocators}
        self._bytes = {p: {st: 0 for st in LeaseState} for p in allocators}
        self.live = 0
        self.keys = KeyIndex()
        self.holds_live = 0
        self.pinned: dict[int, Lease] = {}  # retained features with pins outstanding, as last swept (retention.py)
        self.overdue = 0  # reservations past their reserve_ttl whose ranges are kept (endings.py)

    # --- the lifecycle -------------------------------------------------------------------------

    def fits(self, pool_id: int, nbytes: int) -> bool:
        """A reserve of ``nbytes`` outside any session quota would find a slot and a range now."""
        alloc = self.allocators[pool_id]
        return (self.live < self.max_leases and self.space.has_single
                and alloc.largest_free >= align_up(nbytes, alloc.alignment))

    def reserve(self, session: bytes, pool_id: int, nbytes: int, consumers: int, now: float,
                ttl: Optional[float] = None, quota: bool = True, key: Optional[str] = None,
                retain_ttl: Optional[float] = None) -> Lease:
        """``ttl`` and ``quota`` are for the daemon's own leases (a pulled copy): its hold and no session quota.
        ``key``: bound at publish; ``retain_ttl``: a retained feature, which counts no consumers."""
        alloc = self.allocators[pool_id]
        if nbytes > alloc.capacity:
            self.counters.too_large += 1
            raise MmfeatError(
                ErrorCode.TOO_LARGE,
                f"{nbytes} B is larger than pool {pool_id} ({alloc.capacity} B); send it inline or raise pool_mb",
            )
        self.make_room(session, pool_id, nbytes, now, quota)  # OVER_QUOTA or POOL_FULL before any eviction
        if self.live >= self.max_leases:
            self.counters.pool_full += 1
            raise MmfeatError(ErrorCode.POOL_FULL,
                              f"{self.live} leases are live, the max_leases limit; retry or fall back to inline")
        if quota:
            self.books.admit_single(session, align_up(nbytes, alloc.alignment))
        lease_id = self.space.take()
        if lease_id is None:
            self.counters.pool_full += 1
            raise MmfeatError(ErrorCode.POOL_FULL,
                              "every lease slot is in use (max_leases, arenas included); retry or fall back to inline")
        offset = alloc.alloc(nbytes)
        if offset is None:
            self.space.give(lease_id)
            self.counters.pool_full += 1
            raise MmfeatError(
                ErrorCode.POOL_FULL,
                f"pool {pool_id} has no free range of {nbytes} B "
                f"(free {alloc.free} B, largest {alloc.largest_free} B); "
                "fall back to inline or wait for acks",
            )
        lease = Lease(
            lease_id=lease_id,
            gen=int(self.gens[lease_id]) + 1,
            pool_id=pool_id,
            offset=offset,
            nbytes=nbytes,
            token=secrets.token_bytes(TOKEN_BYTES),
            consumers=consumers,
            remaining=consumers,
            state=LeaseState.RESERVED,
            session=session,
            deadline=now + (self.reserve_ttl if ttl is None else ttl),
            reserved_at=now,
            size=alloc.size_of(offset),
            key=key,
            retain_ttl=retain_ttl,
            keeps_range=quota,
        )
        if retain_ttl is not None:
            # It counts no consumers; the table's count is one no acks reach, so no reader ends it there.
            lease.consumers = lease.remaining = 0
        self._go_live(lease)
        self.live += 1
        self._account(lease, +1)
        if self._table is not None:
            self._table.set_live(lease_id, lease.gen, RESERVED, pool_id, offset, nbytes,
                                 consumers if retain_ttl is None else ACK_COUNT_MASK, lease.token)
        self.books.single_taken(session, lease_id, lease.size)
        self._deadlines.push(lease)
        self.counters.reserves += 1
        return lease

    def publish(self, ref: LeaseRef, session: bytes, now: float, descriptor: Optional[bytes] = None,
                stream_ready: bool = False) -> Lease:
        """The lease published, or for a keyed one whose key another feature took meanwhile, that feature
        (this one is freed: its bytes are not kept). ``stream_ready``: the producer's GPU stream writes
        the slot's READY word behind its write; otherwise the daemon stores it here."""
        lease = self._producers_lease(ref, session, "publish")
        if lease.state is not LeaseState.RESERVED:
            raise MmfeatError(ErrorCode.BAD_STATE,
                              f"lease {lease.lease_id} is already {lease.state.value}; publish once")
        if now >= lease.deadline:
            # Every publish, keyed, retained or counted: the deadline it was granted, whether or not
            # the timer has seen it pass.
            raise self.refuse_late(lease, now, stream_ready)
        if lease.key is not None:
            descriptor = checked_descriptor(descriptor, lease, self.epoch)
            live = self.keys.find(lease.key)
            if live is not None and dedups(live, lease.retain_ttl):
                self.counters.dedups += 1
                self.keys.count(lease.key, "dedups")
                self._free(lease, EndReason.DEDUPED, now)
                return live
            if live is not None:
                # A counted feature's consumers are counted on its own lease: it is published under no
                # key, and the key keeps naming the feature it names.
                lease.key = descriptor = None
        elif descriptor is not None:
            raise MmfeatError(ErrorCode.BAD_REQUEST, f"lease {lease.lease_id} has no key: publish it without a "
                              "descriptor (only keyed features are looked up)")
        self._account(lease, -1)
        lease.state = LeaseState.PUBLISHED
        self._account(lease, +1)
        if self._table is not None:
            self._table.set(lease.lease_id, lease.gen, PUBLISHED, ready=not stream_ready)
        lease.published_at = now
        lease.deadline = now + self.ack_ttl
        self.books.not_reserved(lease.session, lease.lease_id)
        self.counters.publishes += 1
        if lease.retain_ttl is not None:
            lease.deadline = now + lease.retain_ttl
            self.keys.retained(lease)
        if lease.key is not None:
            assert descriptor is not None
            self.keys.bind(lease, lease.key, descriptor)
        if lease.retain_ttl is not None:
            self._deadlines.push(lease)
        elif lease.remaining == 0:
            # Every consumer acked before this publish arrived (it was pipelined): done already.
            self._free(lease, EndReason.ACKED, now)
        else:
            self._deadlines.push(lease)
        return lease

    def ack(self, ref: LeaseRef, count: int, now: float, ack_id: Optional[bytes] = None) -> AckResult:
        lease = self.resolve(ref)
        if ack_id is not None:
            if lease.ack_ids is None:
                lease.ack_ids = set()
            if ack_id in lease.ack_ids:
                self.counters.duplicate_acks += 1
                return AckResult(remaining=lease.remaining, freed=False, over_acked=0, duplicate=True)
            # Bounded: one id per ack that took something, plus a few over-acks.
            if len(lease.ack_ids) <= lease.consumers + 16:
                lease.ack_ids.add(ack_id)
        return self.apply_acks(lease, count, now)

    def apply_acks(self, lease: Lease, count: int, now: float) -> AckResult:
        """``count`` acks for a live lease, from a message or from the lease table's ack word."""
        if lease.retain_ttl is not None or lease.awaiting_bind:
            # A reader of a retained feature without a hold acked its descriptor: nothing counts them.
            self.counters.retained_acks += count
            return AckResult(remaining=0, freed=False, over_acked=0)
        taken = min(count, lease.remaining)
        over = count - taken
        lease.remaining -= taken
        self.counters.acks += taken
        self.counters.over_acks += over
        # A producer pipelines its publish, so a consumer's ack may overtake it on the way in. The data
        # was written before the descriptor existed, so the ack is good; the lease is freed at publish.
        freed = lease.remaining == 0 and lease.state is LeaseState.PUBLISHED
        if freed:
            self._free(lease, EndReason.ACKED, now)
        return AckResult(remaining=lease.remaining, freed=freed, over_acked=over)

    def end(self, lease: Lease, reason: EndReason, now: float) -> None:
        """End a live lease that the lease table shows over (the sweep's call)."""
        self._free(lease, reason, now)

    def release(self, ref: LeaseRef, session: bytes, now: float) -> None:
        lease = self._producers_lease(ref, session, "release")
        self.counters.releases += 1
        self._free(lease, EndReason.RELEASED, now)

    def lookup(self, ref: LeaseRef) -> Lease:
        return self.resolve(ref)

    # --- the sweep's --------------------------------------------------------------------------------

    def clear_block(self, arena: Arena) -> None:
        """A block just granted: no sweep read it before, so words a peer wrote there meanwhile would be
        refused in its new holder's name. Store FREE with each slot's last generation over it (not the
        sweep's last-seen word, which may name an older generation than the daemon spent)."""
        if self._table is not None:
            slots = np.arange(arena.slot_base, arena.slot_base + arena.slots)
            self._table.free_many(slots, self.gens[slots])

    def unheld(self, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` nobody holds: no live lease, and no arena that takes features."""
        blocks = self.arenas.blocks[slots // self.space.block, BLOCK_SIZE]
        return (self.gate[slots] != LIVE_GATE) & (blocks == 0)

    def live_lease(self, slot_id: int) -> Optional[Lease]:
        return self._leases.get(slot_id)

    def slot_gen(self, slot_id: int) -> int:
        return int(self.gens[slot_id])

    def end_generation(self, slot_id: int, gen: int) -> None:
        """A producer took generation ``gen`` of its slot for a feature the sweep refused: it is over."""
        self.gens[slot_id] = self.gate[slot_id] = max(int(self.gens[slot_id]), gen)
        self._ended[slot_id] = END_CODE[EndReason.REFUSED]

    def next_deadline(self) -> float:
        """The earliest deadline of a live lease or a kept unwritten one, for the loop to wake at
        (math.inf: none)."""
        return min(self._deadlines.earliest(), self.unwritten.next_deadline())

    @property
    def timers(self) -> int:
        """Entries in the expiry heap, stale ones included (stats shows it: it must follow live leases)."""
        return len(self._deadlines)

    def count_by_state(self, pool_id: Optional[int] = None) -> dict[str, int]:
        pools = [pool_id] if pool_id is not None else list(self._count)
        return {st.value: sum(self._count[p][st] for p in pools) for st in LeaseState}

    def bytes_by_state(self, pool_id: int) -> dict[str, int]:
        return {st.value: n for st, n in self._bytes[pool_id].items()}

    def _give_back(self, lease: Lease) -> Callable[[], None]:
        """What gives an ended feature's range (and a reserved lease's slot) back."""
        if lease.arena is not None:
            arena = lease.arena
            return lambda: self.arenas.feature_ended(arena, lease.offset, lease.size)

        def single() -> None:
            self.allocators[lease.pool_id].release(lease.offset)
            self.books.single_freed(lease.session, lease.size)
            self.space.give(lease.lease_id)
        return single

    def _account(self, lease: Lease, sign: int) -> None:
        if lease.hold_of is not None:
            return  # a hold owns no bytes: stats count holds on their own
        self._count[lease.pool_id][lease.state] += sign
        self._bytes[lease.pool_id][lease.state] += sign * lease.size

    # --- internals -----------------------------------------------------------------------------

    def resolve(self, ref: LeaseRef) -> Lease:
        """The live lease ``ref`` names, or the typed error that says why there is none."""
        if ref.epoch != self.epoch:
            self.counters.stale += 1
            raise MmfeatError(
                ErrorCode.STALE,
                f"descriptor is from daemon epoch {ref.epoch}, this daemon is epoch {self.epoch}: "
                "the daemon restarted and the feature is gone; re-send it",
            )
        gen = int(self.gens[ref.lease]) if 0 <= ref.lease < len(self.gens) else 0
        if gen == 0 or ref.pool not in self.allocators:
            self.counters.not_found += 1
            raise MmfeatError(ErrorCode.NOT_FOUND, f"no lease {ref.lease} in pool {ref.pool}")
        if ref.gen != gen:
            self.counters.stale += 1
            raise MmfeatError(
                ErrorCode.STALE,
                f"lease {ref.lease} generation {ref.gen} was freed and its slot reused (now generation {gen})",
            )
        lease = self._leases.get(ref.lease)
        if lease is None:
            reason = END_REASONS[self._ended[ref.lease]]
            if reason is EndReason.UNWRITTEN:  # its consumers read bytes its GPU never wrote: a code of its own
                self.counters.lost_reads += 1
                raise MmfeatError(ErrorCode.LOST, f"lease {ref.lease} generation {ref.gen} {reason.value}")
            self.counters.not_found += 1
            why = reason.value if reason is not None else "never reserved"
            raise MmfeatError(ErrorCode.NOT_FOUND, f"lease {ref.lease} generation {ref.gen} is gone: {why}")
        if not hmac.compare_digest(ref.token, lease.token):
            self.counters.forbidden += 1
            raise MmfeatError(ErrorCode.FORBIDDEN, f"wrong token for lease {ref.lease}")
        if (ref.pool, ref.offset, ref.nbytes) != (lease.pool_id, lease.offset, lease.nbytes):
            self.counters.forbidden += 1
            raise MmfeatError(
                ErrorCode.FORBIDDEN,
                f"pool, offset or size do not match lease {ref.lease}: the descriptor is forged or corrupted",
            )
        return lease

    def _producers_lease(self, ref: LeaseRef, session: bytes, op: str) -> Lease:
        lease = self.resolve(ref)
        if not hmac.compare_digest(session, lease.session):
            self.counters.forbidden += 1
            raise MmfeatError(
                ErrorCode.FORBIDDEN,
                f"only the session that reserved lease {ref.lease} may {op} it; a consumer acks instead",
            )
        return lease

    def _go_live(self, lease: Lease) -> None:
        slot = lease.lease_id
        self.gens[slot], self._ended[slot] = lease.gen, 0
        self._leases[slot] = lease
        own = self._own.get(lease.session)
        if own is None:  # not setdefault: that builds a dict for every lease that goes live
            own = self._own[lease.session] = {}
        own[slot] = lease
        self.gate[slot] = LIVE_GATE

    def _free(self, lease: Lease, reason: EndReason, now: float, by_stream: bool = False) -> None:
        """``by_stream``: a RESERVED lease whose producer's GPU stream may still be writing it and its READY
        word (its publish came too late), kept as an unwritten feature is."""
        slot = lease.lease_id
        assert self._leases.get(slot) is lease
        if lease.holds and reason is not EndReason.SHUTDOWN:
            # Readers hold it: no key finds it from now on, and it is freed when the last hold ends.
            lease.doomed = reason
            self.keys.unbind(lease)
            self.keys.not_retained(lease)
            return
        if lease.retain_ttl is not None and reason is not EndReason.SHUTDOWN and not self.close_pins(lease, now):
            self.wait_for_pins(lease, reason, now)
            return
        self.keys.unbind(lease)
        if lease.retain_ttl is not None:
            self.keys.not_retained(lease)
            self.pinned.pop(slot, None)
        if lease.state is LeaseState.RESERVED:
            self.books.not_reserved(lease.session, slot)
            self.overdue -= lease.overdue
        self._account(lease, -1)
        del self._leases[slot]
        own = self._own[lease.session]
        del own[slot]
        if not own:
            del self._own[lease.session]
        self.gate[slot] = lease.gen
        table = self._table
        unwritten = ((lease.state is LeaseState.PUBLISHED or by_stream) and table is not None
                     and lease.pool_id in self.gpu_pools and not table.is_ready(slot, lease.gen)
                     and reason is not EndReason.SHUTDOWN)
        # What a later lookup or waited ack of it says: for a published unwritten one, that its reads were lost.
        lost = unwritten and lease.state is LeaseState.PUBLISHED
        self._ended[slot] = END_CODE[EndReason.UNWRITTEN if lost else reason]
        if lost:
            self.counters.unready_ended += 1
        # FREE in the table first: for an arena slot that store hands slot and space back to the producer.
        if table is not None:
            table.set(slot, lease.gen, FREE, ready=not unwritten, lost=unwritten)
        base = lease.hold_of
        if base is not None:
            self.books.hold_ended(lease.session, slot)
            self.space.give(slot)
        elif unwritten:  # its GPU may still be copying into the range: back once it has (unwritten.py)
            self.unwritten.keep(lease, self._give_back(lease), reason is EndReason.RECLAIMED, now, self.ack_ttl)
        else:
            self._give_back(lease)()
        self.live -= 1
        if base is None:
            self.counters.frees += 1
        else:
            self.holds_live -= 1
            self.counters.holds_ended += 1
        self._deadlines.compact()  # a sweep may end many leases adopted in one go
        for observe in self._observers:
            observe(lease, reason, now)
        if base is not None:
            self._hold_ended(base, now)

