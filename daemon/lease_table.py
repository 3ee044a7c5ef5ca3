"""The lease table: one entry per lease slot (state and generation, pool, offset, size) in a sealed
memfd that clients map read-only. It lets a consumer check that a descriptor names a live lease and
exactly its range without a round trip to the daemon. It holds no feature bytes; the daemon still
never touches those. The layout is mmfeat.protos.lease_table.

Word 0 changes with one aligned 8-byte store, so a reader never sees a new generation with an old
state; the range words are written before word 0 makes their generation live.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from typing import Optional

from mmfeat.protos.lease_table import ENTRY_BYTES, HEADER, HEADER_BYTES, MAGIC, WORDS_PER_ENTRY, table_bytes
# Linux 5.1+: no new writable mappings, while the daemon's existing one stays writable.
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


class LeaseTable:
    def __init__(self, slots: int, epoch: int) -> None:
        self.slots = slots
        self.size = table_bytes(slots)
        self._fd: Optional[int] = os.memfd_create("mmfeat-leases", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, self.size)
        self._mm: Optional[mmap.mmap] = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED)
        self._mm[:HEADER_BYTES] = HEADER.pack(MAGIC, epoch, slots, ENTRY_BYTES).ljust(HEADER_BYTES, b"\0")
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        try:
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, seals | _F_SEAL_FUTURE_WRITE)
        except OSError:  # older kernel: clients still map it read-only by protocol
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, seals)
        self._words = (ctypes.c_uint64 * (slots * WORDS_PER_ENTRY)).from_buffer(self._mm, HEADER_BYTES)

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RuntimeError("lease table is closed")
        return self._fd

    def set(self, slot: int, gen: int, state: int) -> None:
        """A new state for the generation already in the slot (publish), or FREE."""
        self._words[slot * WORDS_PER_ENTRY] = (gen << 2) | state

    def set_live(self, slot: int, gen: int, state: int, pool: int, offset: int, nbytes: int) -> None:
        """A new generation goes live: its range first, then the word that names it."""
        base = slot * WORDS_PER_ENTRY
        words = self._words
        words[base + 1] = pool
        words[base + 2] = offset
        words[base + 3] = nbytes
        words[base] = (gen << 2) | state

    def close(self) -> None:
        if self._mm is not None:
            del self._words
            self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
