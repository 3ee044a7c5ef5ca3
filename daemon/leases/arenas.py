"""Producer arenas: slices of a pool, each with a block of lease slots, granted to one session.

A producer places features in its arena and publishes them in the lease table without a message; the
daemon adopts them on its next sweep (daemon/leases/sweeper.py). An arena is granted from the same allocator
as reserved leases, so one budget covers both. When its producer gives it back or its session ends,
the arena is trimmed: the space not under a live feature goes back to the pool at once, each live
feature keeps its own range until it ends, and the slot block goes back with the last of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from sortedcontainers import SortedDict

from mmfeat.protos.errors import ErrorCode, MmfeatError

from .allocator import Allocator
from .counters import Counters
from .session_books import SessionBooks
from .slots import SlotSpace


@dataclass
class Arena:
    arena_id: int
    session: bytes
    pool_id: int
    offset: int
    size: int
    slot_base: int
    slots: int
    live_bytes: int = 0  # aligned sizes of the features adopted and not yet ended
    returned: bool = False  # trimmed: only its live features' ranges are still allocated
    features: SortedDict = field(default_factory=SortedDict)  # offset -> end of each live feature
    slot_at: dict[int, int] = field(default_factory=dict)  # offset -> slot of each live feature

    @property
    def live(self) -> int:
        return len(self.features)

    @property
    def held(self) -> int:
        """Bytes of the pool this arena holds now."""
        return self.live_bytes if self.returned else self.size

    def inside(self, offset: int, nbytes: int) -> bool:
        return self.offset <= offset and offset + nbytes <= self.offset + self.size

    def overlapping(self, offset: int, nbytes: int) -> list[int]:
        """The slots of the live features that overlap [offset, +nbytes)."""
        features, end = self.features, offset + nbytes
        i = max(0, features.bisect_right(offset) - 1)
        out = []
        for start in features.islice(i):
            if start >= end:
                break
            if features[start] > offset:
                out.append(self.slot_at[start])
        return out

    def fits(self, offset: int, nbytes: int) -> bool:
        """Inside the arena and clear of every live feature (a producer's ring never overlaps two; a
        peer that publishes overlapping ones is refused, so each range is freed exactly once)."""
        end = offset + nbytes
        if not self.inside(offset, nbytes):
            return False
        i = self.features.bisect_right(offset)
        if i and self.features.peekitem(i - 1)[1] > offset:
            return False
        return i == len(self.features) or self.features.peekitem(i)[0] >= end


# Columns of Arenas.blocks.
BLOCK_POOL, BLOCK_OFFSET, BLOCK_SIZE = range(3)
BLOCK_WORDS = 3

# A feature may take at most this share of an arena: the rest holds the features still being read.
MAX_FEATURE_FRACTION = 0.5
# An arena sized for a large feature holds at most this share of its pool.
LARGE_ARENA_SHARE = 8

# Arenas may hold at most this share of a pool, so that reserves (features too large for an arena, and
# producers whose arenas are full) always find room however many producers hold arenas.
ARENA_SHARE = 0.5


class Arenas:
    def __init__(self, allocators: dict[int, Allocator], space: SlotSpace, counters: Counters, books: SessionBooks,
                 arena_bytes: int, per_session: int) -> None:
        self.allocators = allocators
        self.space = space
        self.counters = counters
        self.books = books  # an arena's bytes count against its session's quota like its leases' do
        self.arena_bytes = arena_bytes
        self.per_session = per_session
        self._by_id: dict[int, Arena] = {}
        self._by_block: dict[int, Arena] = {}
        self._by_session: dict[bytes, set[int]] = {}
        self._next_id = 1
        self.bytes = {p: 0 for p in allocators}
        self.live_bytes = {p: 0 for p in allocators}
        # Per slot block, the arena that holds it as (pool, offset, size), with size 0 where none does
        # or its arena takes no new feature (returned). The sweep checks a batch against these at once.
        self.blocks = np.zeros((space.slots // space.block, BLOCK_WORDS), dtype=np.uint64)

    def size_for(self, pool_id: int) -> int:
        """The usual arena size in this pool: the configured size, at most a sixteenth of the pool, so one
        session's usual arenas (arenas_per_session, 4 by default) hold at most a quarter of it. Arenas of
        a large size class (size_to_take) are up to an eighth each; max_session_mb and the half of the
        pool all arenas may hold bound those."""
        alloc = self.allocators[pool_id]
        return max(alloc.alignment, min(self.arena_bytes, alloc.capacity // 16 // alloc.alignment * alloc.alignment))

    def size_to_take(self, pool_id: int, nbytes: Optional[int]) -> int:
        """Arena size in this pool for features up to ``nbytes`` (None: the usual size). A feature over
        half the usual size gets an arena of its own size class, a power of two at least twice it, so
        that it too is published without a message; TOO_LARGE when that is over an eighth of the pool."""
        size = self.size_for(pool_id)
        if nbytes is None or nbytes <= size * MAX_FEATURE_FRACTION:
            return size
        alloc = self.allocators[pool_id]
        size = max(size, 1 << (2 * nbytes - 1).bit_length())
        if size > alloc.capacity // LARGE_ARENA_SHARE:
            self.counters.arenas_refused += 1
            raise MmfeatError(ErrorCode.TOO_LARGE, f"an arena for features of {nbytes} B would be {size} B, over "
                              f"an eighth of pool {pool_id} ({alloc.capacity} B); reserve them instead")
        return size

    def room_for(self, session: bytes, pool_id: int, nbytes: Optional[int] = None) -> bool:
        """grant would find room (quota, arena share, a slot block, a free range) for this arena now.
        Raises what grant would for a size no pool state changes (TOO_LARGE)."""
        size = self.size_to_take(pool_id, nbytes)
        held = self._by_session.get(session, set())
        alloc = self.allocators[pool_id]
        quota = self.books.quota_bytes
        return ((not quota or self.books.bytes_of(session) + size <= quota)
                and len([a for a in held if not self._by_id[a].returned]) < self.per_session
                and self.bytes[pool_id] + size <= alloc.capacity * ARENA_SHARE
                and self.space.has_block and alloc.largest_free >= size)

    def grant(self, session: bytes, pool_id: int, nbytes: Optional[int] = None) -> Arena:
        """A new arena in ``pool_id`` for ``session`` that takes features of up to ``nbytes`` (None: the
        usual size), or the typed error that says why not."""
        size = self.size_to_take(pool_id, nbytes)
        try:
            self.books.check_bytes(session, size, "no arena for it")
        except MmfeatError:
            self.counters.arenas_refused += 1
            raise
        held = self._by_session.get(session, set())
        if len([a for a in held if not self._by_id[a].returned]) >= self.per_session:
            self.counters.arenas_refused += 1
            raise MmfeatError(ErrorCode.OVER_QUOTA, f"this session holds {self.per_session} arenas, the "
                              "arenas_per_session limit; give one back or use reserve")
        alloc = self.allocators[pool_id]
        if self.bytes[pool_id] + size > alloc.capacity * ARENA_SHARE:
            self.counters.arenas_refused += 1
            raise MmfeatError(ErrorCode.POOL_FULL,
                              f"arenas hold {self.bytes[pool_id]} B of pool {pool_id}, and at most half "
                              "of it may be arenas; use reserve")
        base = self.space.take_block()
        if base is None:
            self.counters.arenas_refused += 1
            raise MmfeatError(ErrorCode.POOL_FULL, "no lease slots left for another arena (max_leases); use reserve")
        offset = alloc.alloc(size)
        if offset is None:
            self.space.give_block(base)
            self.counters.arenas_refused += 1
            raise MmfeatError(ErrorCode.POOL_FULL,
                              f"pool {pool_id} has no free range of {size} B for an arena; use reserve")
        arena = Arena(self._next_id, session, pool_id, offset, size, base, self.space.block)
        self._next_id += 1
        self._by_id[arena.arena_id] = arena
        block = base // self.space.block
        self._by_block[block] = arena
        self.blocks[block] = (pool_id, offset, size)
        self._by_session.setdefault(session, set()).add(arena.arena_id)
        self.bytes[pool_id] += size
        self.books.hold(session, size)
        self.counters.arenas_granted += 1
        return arena

    def of_slot(self, slot: int) -> Optional[Arena]:
        """The arena whose block holds ``slot``; None for single slots and free blocks."""
        if slot < self.space.block_start:
            return None
        return self._by_block.get(slot // self.space.block)

    def get(self, arena_id: int) -> Optional[Arena]:
        return self._by_id.get(arena_id)

    def of_session(self, session: bytes) -> list[Arena]:
        return [self._by_id[a] for a in self._by_session.get(session, ())]

    def feature_added(self, arena: Arena, slot: int, offset: int, size: int) -> None:
        arena.features[offset] = offset + size
        arena.slot_at[offset] = slot
        arena.live_bytes += size
        self.live_bytes[arena.pool_id] += size

    def feature_ended(self, arena: Arena, offset: int, size: int) -> int:
        """Account an ended feature; the bytes that went back to the pool (none while its producer
        still holds the arena)."""
        del arena.features[offset]
        del arena.slot_at[offset]
        arena.live_bytes -= size
        self.live_bytes[arena.pool_id] -= size
        if not arena.returned:
            return 0
        self.allocators[arena.pool_id].release(offset)
        self.bytes[arena.pool_id] -= size
        self.books.unhold(arena.session, size)
        if arena.live == 0:
            self._drop(arena)
        return size

    def give_back(self, arena: Arena) -> int:
        """Its producer will place nothing more in it (or is gone): the space outside its live features
        goes back now, theirs as each ends. The bytes freed now."""
        if arena.returned:
            return 0
        arena.returned = True
        self.blocks[arena.slot_base // self.space.block, BLOCK_SIZE] = 0
        self.counters.arenas_returned += 1
        keep = [(offset, end - offset) for offset, end in arena.features.items()]
        freed = self.allocators[arena.pool_id].trim(arena.offset, keep)
        self.bytes[arena.pool_id] -= freed
        if freed:
            self.books.unhold(arena.session, freed)
        if arena.live == 0:
            self._drop(arena)
        return freed

    def give_back_session(self, session: bytes) -> int:
        """The session ended: every arena it held goes back (each once its live features end). How many."""
        arenas = self.of_session(session)
        for arena in arenas:
            self.give_back(arena)
        return len(arenas)

    def _drop(self, arena: Arena) -> None:
        """Nothing in the returned arena is live: its slot block goes back too."""
        del self._by_id[arena.arena_id]
        del self._by_block[arena.slot_base // self.space.block]
        ids = self._by_session[arena.session]
        ids.discard(arena.arena_id)
        if not ids:
            del self._by_session[arena.session]
        self.space.give_block(arena.slot_base)
        self.counters.arenas_freed += 1

    def count(self, pool_id: int) -> int:
        return sum(1 for a in self._by_id.values() if a.pool_id == pool_id)

    def slack(self, pool_id: int) -> int:
        """Bytes held by arenas and not under a live feature: what producers have ahead of need."""
        return sum(a.size - a.live_bytes for a in self._by_id.values() if a.pool_id == pool_id and not a.returned)
