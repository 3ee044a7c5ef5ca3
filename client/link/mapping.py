"""Host pool mappings, shared by the sessions of a process through a cache keyed by endpoint, pool and epoch.

The cache holds them weakly: the sessions using a mapping hold it, and tensors from get() hold its pages.
Once the last session closes and the last such tensor is gone, the pages are unmapped, so a process that
outlives its daemon, or talks to several, does not keep a pool's memory allocated for the rest of its life
(a deleted memfd's pages stay allocated while anything maps them).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from ..neutral import outside_inference


@dataclass
class HostMapping:
    pool_id: int
    epoch: int
    size: int
    tensor: Any  # torch.uint8 tensor over the whole pool; it keeps the mmap alive
    readonly: bool = False
    # The same pages registered with the CUDA driver (client/consume/pinned.py), made on a GPU consumer's first
    # staged get and kept as long as the mapping; pin_error: why it could not be, so it is not retried.
    pinned: Any = None
    pin_error: Optional[str] = None
    pin_owner: Any = None  # the registration: which devices copied from the pages, for its teardown


_lock = threading.Lock()
_cache: "weakref.WeakValueDictionary[tuple[str, int, int, bool], HostMapping]" = weakref.WeakValueDictionary()


def _new_lock_in_child() -> None:
    # A thread of the parent mapping a pool at the fork (MAP_POPULATE of a whole pool takes a while)
    # holds the lock in the child for good: the child's first session would wait for it forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def map_host_pool(endpoint: str, pool_id: int, epoch: int, fd: int, size: int, readonly: bool = False) -> HostMapping:
    """Map the pool behind ``fd`` (closing ``fd`` either way) unless a session of this process has it
    mapped already; the caller keeps the mapping for as long as it uses it.
    ``readonly`` maps it ``PROT_READ`` only, through a read-only fd: a write into it faults (SIGSEGV)."""
    import torch

    try:
        with _lock:
            hit = _cache.get((endpoint, pool_id, epoch, readonly))
            if hit is not None:
                return hit
            # A new epoch for this endpoint means the daemon restarted: forget the old pool. Its memory
            # goes back once the last tensor viewing it is gone.
            for key in [k for k in _cache if k[0] == endpoint and k[2] != epoch]:
                _cache.pop(key, None)
            if os.fstat(fd).st_size < size:
                raise ValueError(f"pool fd is {os.fstat(fd).st_size} B, daemon said {size} B")
            # MAP_POPULATE: take the page faults here, once, not on the hot path.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            if readonly:
                mm = _map_read_only(fd, size, flags)
            else:
                mm = mmap.mmap(fd, size, flags=flags)
            with outside_inference():  # shared by every later put and get: client/neutral.py
                tensor = torch.frombuffer(mm, dtype=torch.uint8)
            mapping = HostMapping(pool_id, epoch, size, tensor, readonly)
            _cache[(endpoint, pool_id, epoch, readonly)] = mapping
            return mapping
    finally:
        os.close(fd)


def _map_read_only(fd: int, size: int, flags: int) -> mmap.mmap:
    # Through a fd reopened read-only, not the daemon's read-write one: the kernel then refuses to make
    # the pages writable again (mprotect), so no library in this process can turn the mapping writable.
    # Without /proc the mapping is still PROT_READ.
    try:
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    try:
        return mmap.mmap(ro, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(ro)  # the mmap object holds its own duplicate
