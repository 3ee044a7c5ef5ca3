"""Best-fit range allocator with coalescing over one pool. O(log n) per alloc and free.

The daemon never touches pool bytes: this only hands out ``[offset, offset + size)`` ranges.
"""

from __future__ import annotations

from typing import Iterable, Optional

from sortedcontainers import SortedDict, SortedList

from mmfeat.protos.descriptor import LEASE_ALIGNMENT

ALIGNMENT = LEASE_ALIGNMENT


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


class Allocator:
    def __init__(self, capacity: int, alignment: int = ALIGNMENT) -> None:
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._by_size: SortedList = SortedList()  # (size, offset) of free ranges
        self._by_offset: SortedDict = SortedDict()  # offset -> size of free ranges
        self._allocated: dict[int, int] = {}  # offset -> size
        self.used = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def free_ranges(self) -> int:
        return len(self._by_offset)

    def largest_after(self, ranges: Iterable[tuple[int, int]]) -> int:
        """The largest free range there would be once the allocated ``ranges`` ((offset, size) pairs, as
        ``size_of`` says) were released; nothing changes. O(n log n) in free and given ranges."""
        best, start, end = self.largest_free, -1, -1
        for offset, size in sorted([*self._by_offset.items(), *ranges]):
            if offset != end:
                start = offset
            end = offset + size
            best = max(best, end - start)
        return best

    def alloc(self, nbytes: int) -> Optional[int]:
        """Offset of a new range of at least ``nbytes`` (rounded up to the alignment), or None if full."""
        if nbytes <= 0:
            raise ValueError("allocation size must be positive")
        size = align_up(nbytes, self.alignment)
        i = self._by_size.bisect_left((size, -1))
        if i == len(self._by_size):
            return None
        free_size, offset = self._by_size[i]
        self._remove_free(offset, free_size)
        if free_size > size:
            self._add_free(offset + size, free_size - size)
        self._allocated[offset] = size
        self.used += size
        return offset

    def size_of(self, offset: int) -> int:
        return self._allocated[offset]

    def release(self, offset: int) -> int:
        """Return the range at ``offset`` to the free set, merging with free neighbours; its size."""
        size = self._allocated.pop(offset)  # KeyError on a double free: the ledger must never do that
        self.used -= size
        start, end = offset, offset + size
        i = self._by_offset.bisect_left(offset)
        if i > 0:
            prev_off = self._by_offset.keys()[i - 1]
            prev_size = self._by_offset[prev_off]
            if prev_off + prev_size == start:
                self._remove_free(prev_off, prev_size)
                start = prev_off
        nxt = self._by_offset.get(end)
        if nxt is not None:
            self._remove_free(end, nxt)
            end += nxt
        self._add_free(start, end - start)
        return size

    def trim(self, offset: int, keep: list[tuple[int, int]]) -> int:
        """Shrink the range at ``offset`` to the ranges in ``keep`` ((offset, size) pairs, sorted, disjoint,
        aligned, inside it), each becoming a range of its own; the rest goes back free. Bytes freed."""
        size = self._allocated.pop(offset)
        self.used -= size
        pos, end = offset, offset + size
        for k_off, k_size in keep:
            if not (pos <= k_off and k_off + k_size <= end):
                raise ValueError(f"kept range [{k_off}, +{k_size}) is not inside [{pos}, {end})")
            if k_off > pos:
                self._give_back(pos, k_off - pos)
            self._allocated[k_off] = k_size
            self.used += k_size
            pos = k_off + k_size
        if pos < end:
            self._give_back(pos, end - pos)
        return size - sum(k for _, k in keep)

    def _give_back(self, offset: int, size: int) -> None:
        self._allocated[offset] = size
        self.used += size
        self.release(offset)

    def _add_free(self, offset: int, size: int) -> None:
        self._by_offset[offset] = size
        self._by_size.add((size, offset))

    def _remove_free(self, offset: int, size: int) -> None:
        del self._by_offset[offset]
        self._by_size.remove((size, offset))
