"""Host pool mappings, made once per process and kept in a cache keyed by endpoint, pool and epoch."""

from __future__ import annotations

import mmap
import os
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
