"""Pool and lease-table mappings, made once per process and kept in caches keyed by endpoint and epoch."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any

from mmfeat.protos.lease_table import ENTRY, FREE, HEADER, MAGIC, entry_offset, table_bytes


@dataclass
class HostMapping:
    pool_id: int
    epoch: int
    size: int
    tensor: Any  # torch.uint8 tensor over the whole pool; it keeps the mmap alive


_lock = threading.Lock()
_cache: dict[tuple[str, int, int], Any] = {}


def map_host_pool(endpoint: str, pool_id: int, epoch: int, fd: int, size: int) -> HostMapping:
    """Map the pool behind ``fd`` (closing ``fd`` either way) unless this process already has it."""
    import torch

    try:
        with _lock:
            hit = _cache.get((endpoint, pool_id, epoch))
            if hit is not None:
                return hit
            # A new epoch for this endpoint means the daemon restarted: forget the old pool. Its memory
            # goes back once the last tensor viewing it is gone.
            for key in [k for k in _cache if k[0] == endpoint and k[2] != epoch]:
                del _cache[key]
            if os.fstat(fd).st_size < size:
                raise ValueError(f"pool fd is {os.fstat(fd).st_size} B, daemon said {size} B")
            # MAP_POPULATE: take the page faults here, once, not on the hot path.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
            mapping = HostMapping(pool_id, epoch, size, tensor)
            _cache[(endpoint, pool_id, epoch)] = mapping
            return mapping
    finally:
        os.close(fd)


STATE_FREE = FREE
# state() for a live lease whose pool, offset or size differ from what the descriptor says.
STATE_MISMATCH = -1


class LeaseTableView:
    """Read-only view of the daemon's lease table: is a descriptor's lease live, with exactly its
    range, without a round trip."""

    def __init__(self, mm: mmap.mmap, slots: int) -> None:
        self._mm = mm
        self.slots = slots

    def state(self, lease: int, gen: int, pool: int, offset: int, nbytes: int) -> int:
        """The lease's state if its slot holds generation ``gen`` with this range; STATE_FREE if the
        generation is gone, STATE_MISMATCH if it is live with another range."""
        if lease >= self.slots:
            return STATE_FREE
        at = entry_offset(lease)
        (word,) = _WORD.unpack_from(self._mm, at)
        if word >> 2 != gen or not word & 3:
            return STATE_FREE
        # The range words were written before word 0 named this generation; reading word 0 again
        # proves they still belong to it (generations only grow, so no ABA).
        entry = ENTRY.unpack_from(self._mm, at)
        (again,) = _WORD.unpack_from(self._mm, at)
        if again != word:
            return STATE_FREE
        if entry[1:] != (pool, offset, nbytes):
            return STATE_MISMATCH
        return word & 3


_WORD = struct.Struct("<Q")
_tables: dict[tuple[str, int], LeaseTableView] = {}


def map_lease_table(endpoint: str, epoch: int, fd: int, slots: int) -> LeaseTableView:
    """Map the lease table behind ``fd`` read-only (closing ``fd`` either way), once per daemon epoch."""
    try:
        with _lock:
            hit = _tables.get((endpoint, epoch))
            if hit is not None:
                return hit
            for key in [k for k in _tables if k[0] == endpoint]:
                del _tables[key]
            size = table_bytes(slots)
            if os.fstat(fd).st_size < size:
                raise ValueError(f"lease table fd is {os.fstat(fd).st_size} B, daemon said {size} B")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            magic, table_epoch, table_slots, entry_bytes = HEADER.unpack_from(mm, 0)
            if magic != MAGIC or table_epoch != epoch or table_slots != slots or entry_bytes != ENTRY.size:
                mm.close()
                raise ValueError("the lease table's header does not match the daemon's hello")
            view = LeaseTableView(mm, slots)
            _tables[(endpoint, epoch)] = view
            return view
    finally:
        os.close(fd)
