"""Acquire loads, release stores and compare-and-swap on aligned 8-byte words in shared memory.

Publishes and acks are stores into the lease table that other processes read without a message, so
each must be ordered after the payload writes or reads it covers. x86-64 keeps that order for plain
stores; aarch64 (Grace, GB200) does not, and Python has no fence. These call libatomic's
``__atomic_*_8`` functions through ctypes (about 0.3 µs a call), which compile to the right
instructions on each architecture: ``ldar``/``stlr``/``casal`` on aarch64, plain moves and
``lock cmpxchg`` on x86-64. libatomic ships with GCC's runtime on every mainstream distribution;
where it is missing, ``AVAILABLE`` is False and clients use the message path instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any, Optional

# C11 memory orders, as libatomic numbers them.
RELAXED, ACQUIRE, RELEASE, SEQ_CST = 0, 2, 3, 5


def _load_library() -> Optional[ctypes.CDLL]:
    if os.environ.get("MMFEAT_NO_ATOMICS") == "1":  # to run the message path on purpose (tests, triage)
        return None
    for name in (ctypes.util.find_library("atomic"), "libatomic.so.1"):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


_lib = _load_library()
AVAILABLE = _lib is not None

if _lib is not None:
    _load8 = _lib.__atomic_load_8
    _load8.argtypes, _load8.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
    _store8 = _lib.__atomic_store_8
    _store8.argtypes, _store8.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int], None
    _cas8 = _lib.__atomic_compare_exchange_8
    _cas8.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
    _cas8.restype = ctypes.c_bool
    _fence = _lib.atomic_thread_fence
    _fence.argtypes, _fence.restype = [ctypes.c_int], None


def fence_acquire() -> None:
    """Order the loads before this call before every load and store after it (a bulk read, such as a
    numpy copy of a column, followed by reads that depend on what it saw)."""
    if _lib is not None:
        _fence(ACQUIRE)


class Words:
    """The 8-byte words of a writable shared mapping, addressed by index from ``offset``.

    Holds an exported pointer into the mapping: call ``close`` before closing the mmap.
    """

    def __init__(self, buffer: Any, offset: int, count: int) -> None:
        self._anchor: Optional[ctypes.Array] = (ctypes.c_char * (count * 8)).from_buffer(buffer, offset)
        self._base = ctypes.addressof(self._anchor)
        self.count = count

    def load(self, i: int) -> int:
        """Acquire load of word ``i``: what the writer stored before releasing it is visible after."""
        if not 0 <= i < self.count:
            raise IndexError(i)
        if _lib is None:
            return ctypes.c_uint64.from_address(self._base + 8 * i).value
        return _load8(self._base + 8 * i, ACQUIRE)

    def store(self, i: int, value: int) -> None:
        """Release store of word ``i``: every earlier load and store of this thread happens before it."""
        if not 0 <= i < self.count:
            raise IndexError(i)
        if _lib is None:
            ctypes.c_uint64.from_address(self._base + 8 * i).value = value
        else:
            _store8(self._base + 8 * i, value, RELEASE)

    def cas(self, i: int, expected: int, new: int) -> tuple[bool, int]:
        """Sequentially consistent compare-and-swap of word ``i``; (swapped, the value seen)."""
        if not 0 <= i < self.count:
            raise IndexError(i)
        if _lib is None:
            raise RuntimeError("compare-and-swap needs libatomic (not found); the message path does not use it")
        box = ctypes.c_uint64(expected)
        ok = _cas8(self._base + 8 * i, ctypes.byref(box), new, SEQ_CST, SEQ_CST)
        return bool(ok), box.value

    # The same at a byte offset the caller has already checked to be inside the mapping (8-aligned):
    # the lease table's hot paths, which check their slot numbers once.

    def load_at(self, offset: int) -> int:
        if _lib is None:
            return ctypes.c_uint64.from_address(self._base + offset).value
        return _load8(self._base + offset, ACQUIRE)

    def store_at(self, offset: int, value: int) -> None:
        if _lib is None:
            ctypes.c_uint64.from_address(self._base + offset).value = value
        else:
            _store8(self._base + offset, value, RELEASE)

    def close(self) -> None:
        self._anchor = None
        self._base = 0
        self.count = 0
