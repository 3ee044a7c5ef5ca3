"""Pool and lease-table mappings, made once per process and kept in caches keyed by endpoint and epoch."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any


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


_TABLE_MAGIC = b"MMFTABL1"
_TABLE_HEADER = 64
STATE_FREE, STATE_RESERVED, STATE_PUBLISHED = 0, 1, 2


class LeaseTableView:
    """Read-only view of the daemon's lease table: ``state(lease, gen)`` without a round trip."""

    def __init__(self, mm: mmap.mmap, slots: int) -> None:
        self._mm = mm
        self.slots = slots

    def state(self, lease: int, gen: int) -> int:
        """The lease's state if its slot still holds generation ``gen``; STATE_FREE otherwise."""
        if lease >= self.slots:
            return STATE_FREE
        # One aligned 8-byte load: generation and state always come from the same write.
        (word,) = struct.unpack_from("<Q", self._mm, _TABLE_HEADER + 8 * lease)
        return word & 3 if word >> 2 == gen else STATE_FREE


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
            size = _TABLE_HEADER + 8 * slots
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            magic, table_epoch, table_slots = struct.unpack_from("<8sQQ", mm, 0)
            if magic != _TABLE_MAGIC or table_epoch != epoch or table_slots != slots:
                mm.close()
                raise ValueError("the lease table's header does not match the daemon's hello")
            view = LeaseTableView(mm, slots)
            _tables[(endpoint, epoch)] = view
            return view
    finally:
        os.close(fd)
