"""Lease slots: single slots for reserved leases, blocks of slots for producer arenas.

Singles grow up from slot 0 and blocks down from the top of the table, so the daemon's sweep reads two
dense ranges however many slots the table has. Block bases are multiples of the block size, so the
block a slot belongs to is one division away.
"""

from __future__ import annotations

from typing import Optional


class SlotSpace:
    def __init__(self, slots: int, block: int) -> None:
        self.slots = slots
        self.block = block
        self.single_end = 0  # every single slot ever used is below this
        self.block_start = slots - slots % block  # every block ever granted is at or above this
        self._free_singles: list[int] = []
        self._free_blocks: list[int] = []

    def take(self) -> Optional[int]:
        """A single slot, or None when singles and blocks have met."""
        if self._free_singles:
            return self._free_singles.pop()
        if self.single_end < self.block_start:
            self.single_end += 1
            return self.single_end - 1
        return None

    def give(self, slot: int) -> None:
        self._free_singles.append(slot)

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

    def give_block(self, base: int) -> None:
        self._free_blocks.append(base)

    def ranges(self) -> list[tuple[int, int]]:
        """The slot ranges a sweep reads: singles, then blocks."""
        top = self.slots - self.slots % self.block
        return [r for r in ((0, self.single_end), (self.block_start, top)) if r[0] < r[1]]
