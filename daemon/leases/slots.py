"""Lease slots: single slots for reserved leases, blocks of slots for producer arenas.

Singles grow up from slot 0 and blocks down from the top of the table, so the daemon's sweep reads two
dense ranges however many slots the table has. Block bases are multiples of the block size, so the
block a slot belongs to is one division away. The single range shrinks again as its top slots free, and
the lowest free single is taken first: a session that once held many single slots leaves no wide range
for every later sweep to read (SPEC.md, section 9).
"""

from __future__ import annotations

import heapq
from typing import Optional


class SlotSpace:
    def __init__(self, slots: int, block: int) -> None:
        self.slots = slots
        self.block = block
        self.single_end = 0  # every single slot in use is below this
        self.block_start = slots - slots % block  # every block ever granted is at or above this
        # Free singles below single_end: a set, and a min-heap of them that may hold stale entries (slots
        # taken again, or cut off when the range shrank), skipped when popped and dropped on a rebuild.
        self._free_singles: set[int] = set()
        self._heap: list[int] = []
        self._free_blocks: list[int] = []

    def take(self) -> Optional[int]:
        """The lowest free single slot, or None when singles and blocks have met."""
        while self._heap:
            slot = heapq.heappop(self._heap)
            if slot in self._free_singles:
                self._free_singles.discard(slot)
                return slot
        if self.single_end < self.block_start:
            self.single_end += 1
            return self.single_end - 1
        return None

    def give(self, slot: int) -> None:
        self._free_singles.add(slot)
        if slot != self.single_end - 1:
            heapq.heappush(self._heap, slot)
            if len(self._heap) > 2 * len(self._free_singles) + 64:
                self._heap = sorted(self._free_singles)  # a sorted list is a heap
            return
        while self.single_end and self.single_end - 1 in self._free_singles:
            self.single_end -= 1
            self._free_singles.discard(self.single_end)

    @property
    def has_single(self) -> bool:
        """take() would return a slot."""
        return bool(self._free_singles) or self.single_end < self.block_start

    def take_block(self) -> Optional[int]:
        """The first slot of a free block, or None."""
        if self._free_blocks:
            return self._free_blocks.pop()
        if self.block_start - self.block >= self.single_end:
            self.block_start -= self.block
            return self.block_start
        return None

    @property
    def has_block(self) -> bool:
        """take_block() would return a block."""
        return bool(self._free_blocks) or self.block_start - self.block >= self.single_end

    def give_block(self, base: int) -> None:
        self._free_blocks.append(base)

    def ranges(self) -> list[tuple[int, int]]:
        """The slot ranges a sweep reads: singles, then blocks."""
        top = self.slots - self.slots % self.block
        return [r for r in ((0, self.single_end), (self.block_start, top)) if r[0] < r[1]]

    @property
    def swept(self) -> int:
        """Slots a sweep reads."""
        return sum(hi - lo for lo, hi in self.ranges())
