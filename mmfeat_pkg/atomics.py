"""Acquire loads, release stores and compare-and-swap on aligned 8-byte words in shared memory.

Publishes and acks are stores into the lease table that other processes read without a message, so
each must be ordered after the payload writes or reads it covers. x86-64 keeps that order for plain
stores; aarch64 (Grace, GB200) does not, and Python has no fence. These call libatomic's
``__atomic_*_8`` functions through ctypes (0.4-1.8 µs a call), which compile to the right
instructions on each architecture: ``ldar``/``stlr``/``casal`` on aarch64, plain moves and
``lock cmpxchg`` on x86-64. libatomic ships with GCC's runtime on every mainstream distribution;
where it is missing, ``AVAILABLE`` is False and clients use the message path instead.

On x86-64 an acquire load and a release store *are* a plain aligned 8-byte move (what libatomic runs
there too), so loads and stores go through a memoryview of the words instead (0.06 µs): the hardware
keeps stores in order with earlier loads and stores, and loads in order with later ones (TSO), and
the interpreter's calls are opaque to the C compiler. glibc fences its own non-temporal copies. The
acquire fence is then nothing, as it is for GCC on x86-64. Compare-and-swap always needs libatomic.
``MMFEAT_ATOMICS=libatomic`` takes the libatomic path for loads and stores too (tests, triage).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from typing import Any, Optional

# C11 memory orders, as libatomic numbers them.
RELAXED, ACQUIRE, RELEASE, SEQ_CST = 0, 2, 3, 5


def _load_library() -> Optional[ctypes.CDLL]:
    if os.environ.get("MMFEAT_NO_ATOMICS") == "1":  # to run the message path on purpose (tests, triage)
        return None
    # The soname first: find_library runs ldconfig (or gcc) in a subprocess, which a sandboxed or slim
    # container may not have, and which costs a fork at every import.
    try:
        return ctypes.CDLL("libatomic.so.1")
    except OSError:
        pass
    from ctypes.util import find_library

    name = find_library("atomic")
    if name:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    return None


_lib = _load_library()
AVAILABLE = _lib is not None
# Loads and stores as plain moves: x86-64's own memory model gives them acquire and release order.
PLAIN_ORDERED = (AVAILABLE and platform.machine().lower() in ("x86_64", "amd64")
                 and os.environ.get("MMFEAT_ATOMICS") != "libatomic")

if _lib is not None:
    _load8 = _lib.__atomic_load_8
    _load8.argtypes, _load8.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
    _store8 = _lib.__atomic_store_8
    _store8.argtypes, _store8.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int], None
    # The expected value goes by address, from a box kept per thread: making a c_uint64 and a byref for
    # each call costs a noticeable share of the call itself, and the last ack of a feature makes two.
    # PYFUNCTYPE: called with the GIL held, as a few nanoseconds of work should be; releasing and taking
    # it back would cost more than the swap itself.
    _cas8 = ctypes.PYFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                             ctypes.c_int)(("__atomic_compare_exchange_8", _lib))
    _fence = _lib.atomic_thread_fence
    _fence.argtypes, _fence.restype = [ctypes.c_int], None


_boxes = threading.local()


def _box() -> tuple[ctypes.c_uint64, int]:
    """This thread's c_uint64 for compare-and-swap's expected value, and its address."""
    box = getattr(_boxes, "box", None)
    if box is None:
        value = ctypes.c_uint64()
        box = _boxes.box = (value, ctypes.addressof(value))
    return box


# Whether fence_acquire does anything here: hot paths test this instead of calling it for nothing.
FENCE_NEEDED = _lib is not None and not PLAIN_ORDERED


def fence_acquire() -> None:
    """Order the loads before this call before every load and store after it (a bulk read, such as a
    numpy copy of a column, followed by reads that depend on what it saw)."""
    if _lib is not None and not PLAIN_ORDERED:
        _fence(ACQUIRE)


class Words:
    """The 8-byte words of a writable shared mapping, addressed by index from ``offset``.

    Holds an exported pointer into the mapping: call ``close`` before closing the mmap.
    """

    def __init__(self, buffer: Any, offset: int, count: int, plain: Optional[bool] = None) -> None:
        self._anchor: Optional[ctypes.Array] = (ctypes.c_char * (count * 8)).from_buffer(buffer, offset)
        self._base = ctypes.addressof(self._anchor)
        self.count = count
        # The same words as 8-byte items, for plain loads and stores (x86-64 only: see the module doc);
        # ``plain=False`` takes libatomic's calls instead, as on other architectures.
        if plain and not PLAIN_ORDERED:
            raise ValueError("plain loads and stores are acquire/release only on x86-64 (and need libatomic's CAS)")
        use_plain = PLAIN_ORDERED if plain is None else plain
        self._plain: Optional[memoryview] = memoryview(self._anchor).cast("B").cast("Q") if use_plain else None

    def plain_view(self) -> Optional[memoryview]:
        """The words as a memoryview of 8-byte items where plain loads and stores are acquire and release
        (x86-64): indexing it reads a word with no Python frame. None elsewhere: use load_at."""
        return self._plain

    def load(self, i: int) -> int:
        """Acquire load of word ``i``: what the writer stored before releasing it is visible after."""
        if not 0 <= i < self.count:
            raise IndexError(i)
        return self.load_at(8 * i)

    def store(self, i: int, value: int) -> None:
        """Release store of word ``i``: every earlier load and store of this thread happens before it."""
        if not 0 <= i < self.count:
            raise IndexError(i)
        self.store_at(8 * i, value)

    def cas(self, i: int, expected: int, new: int) -> tuple[bool, int]:
        """Sequentially consistent compare-and-swap of word ``i``; (swapped, the value seen)."""
        if not 0 <= i < self.count:
            raise IndexError(i)
        return self.cas_at(8 * i, expected, new)

    # The same at a byte offset the caller has already checked to be inside the mapping (8-aligned):
    # the lease table's hot paths, which check their slot numbers once.

    def load_at(self, offset: int) -> int:
        plain = self._plain
        if plain is not None:
            return plain[offset >> 3]
        if _lib is None:
            return ctypes.c_uint64.from_address(self._base + offset).value
        return _load8(self._base + offset, ACQUIRE)

    def cas_at(self, offset: int, expected: int, new: int) -> tuple[bool, int]:
        if _lib is None:
            raise RuntimeError("compare-and-swap needs libatomic (not found); the message path does not use it")
        try:
            box, address = _boxes.box  # each ack makes one or two: no helper frame for the common case
        except AttributeError:
            box, address = _box()
        box.value = expected
        ok = _cas8(self._base + offset, address, new, SEQ_CST, SEQ_CST)
        return ok, box.value

    def store_at(self, offset: int, value: int) -> None:
        plain = self._plain
        if plain is not None:
            plain[offset >> 3] = value
        elif _lib is None:
            ctypes.c_uint64.from_address(self._base + offset).value = value
        else:
            _store8(self._base + offset, value, RELEASE)

    def close(self) -> None:
        if self._plain is not None:
            self._plain.release()
            self._plain = None
        self._anchor = None
        self._base = 0
        self.count = 0
