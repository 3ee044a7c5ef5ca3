"""Host memory pool: one sealed memfd, populated at creation, exported as a POSIX fd."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from typing import Optional

from .base import Pool, PoolCreateError


def available_memory() -> int:
    """Bytes this process can still populate: MemAvailable, capped by the cgroup v2 limit if any.

    shmem fallocate does not fail early when memory runs out; it invokes the OOM killer, which may
    pick any process on the node. So the daemon checks first.
    """
    avail = 1 << 62
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            used = int(open("/sys/fs/cgroup/memory.current").read())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


class HostPool(Pool):
    kind = "host"
    device = -1
    handle = "posix_fd"

    def __init__(self, pool_id: int, size: int) -> None:
        self.pool_id = pool_id
        self.size = size
        self._fd: Optional[int] = None
        self._map: Optional[mmap.mmap] = None
        avail = available_memory()
        if size > avail:
            raise PoolCreateError(
                f"a {size >> 20} MiB host pool does not fit: {avail >> 20} MiB of memory is available "
                "(MemAvailable, or the cgroup limit); lower pool_mb"
            )
        self._fd = os.memfd_create(f"mmfeat-pool{pool_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, size)
            # Allocate every page now: a node short of memory fails here, at start, rather than with
            # SIGBUS in some consumer on first touch.
            os.posix_fallocate(self._fd, 0, size)
            # Clients get this fd too; seals stop any of them from shrinking it under the others.
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except OSError as exc:
            self.close()
            raise PoolCreateError(
                f"cannot populate a {size >> 20} MiB host pool: {exc.strerror}; lower pool_mb or free memory "
                "(inside a container, check its memory limit and /dev/shm size)"
            ) from None

    def export_fd(self) -> Optional[int]:
        if self._fd is None:
            raise RuntimeError("pool is closed")
        return self._fd

    def map_for_pulls(self) -> Optional[tuple[int, str, int]]:
        # The daemon never touches feature bytes itself; this mapping is only for NIXL to serve peers' READs.
        if self._fd is None:
            raise RuntimeError("pool is closed")
        if self._map is None:
            # Populated: a READ into (or out of) a page this process never touched would take a page fault
            # per 4 KiB inside the transfer, a millisecond per 16 MiB.
            self._map = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        view = ctypes.c_char.from_buffer(self._map)
        addr = ctypes.addressof(view)
        del view  # a live export would keep the mapping from ever closing
        return addr, "DRAM", 0

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
