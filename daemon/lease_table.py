"""The lease table: one 8-byte word per lease slot, ``generation << 2 | state``, in a sealed memfd that
clients map read-only. It lets a consumer check that a descriptor's lease is still live without a
round trip to the daemon. It holds no feature bytes; the daemon still never touches those.

One aligned 8-byte store per change, so a reader never sees a new generation with an old state.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
from typing import Optional

MAGIC = b"MMFTABL1"
HEADER_BYTES = 64  # magic (8), epoch (8), slots (8), reserved
WORD_BYTES = 8
FREE, RESERVED, PUBLISHED = 0, 1, 2
# Linux 5.1+: no new writable mappings, while the daemon's existing one stays writable.
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def table_bytes(slots: int) -> int:
    return HEADER_BYTES + slots * WORD_BYTES


class LeaseTable:
    def __init__(self, slots: int, epoch: int) -> None:
        self.slots = slots
        self.size = table_bytes(slots)
        self._fd: Optional[int] = os.memfd_create("mmfeat-leases", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, self.size)
        self._mm: Optional[mmap.mmap] = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED)
        self._mm[: HEADER_BYTES] = struct.pack("<8sQQ", MAGIC, epoch, slots).ljust(HEADER_BYTES, b"\0")
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        try:
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, seals | _F_SEAL_FUTURE_WRITE)
        except OSError:  # older kernel: clients still map it read-only by protocol
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, seals)
        self._words = (ctypes.c_uint64 * slots).from_buffer(self._mm, HEADER_BYTES)

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RuntimeError("lease table is closed")
        return self._fd

    def set(self, slot: int, gen: int, state: int) -> None:
        self._words[slot] = (gen << 2) | state

    def close(self) -> None:
        if self._mm is not None:
            del self._words
            self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
