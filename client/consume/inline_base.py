"""An inline feature's payload as a uint8 tensor that views of any dtype can sit on.

Every view ``get`` returns starts on a multiple of PAYLOAD_ALIGNMENT, as torch's own allocator aligns
(a misaligned complex view can end the process inside a torch kernel). A producer lays the payload out
aligned from the descriptor's first byte (protos/inline_wire.py), but the buffer a consumer receives
need not start aligned: a bytes object's data sits at an offset inside the object, a zmq Frame's
anywhere. Such a payload is copied once into aligned memory; an aligned one is viewed where it lies.

A readonly Client gets the payload copied into pages mapped read-only, as its pool mapping is: a write
into the view faults (SIGSEGV) instead of changing the bytes another consumer of the same descriptor
reads.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from typing import Any, Optional, Union

import torch

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.inline_wire import PAYLOAD_ALIGNMENT

Buffer = Union[bytes, bytearray, memoryview, Any]

def inline_base(data: Buffer, nbytes: int, *, copy: bool, readonly: bool) -> torch.Tensor:
    """A uint8 tensor of ``data``'s ``nbytes``, its first byte aligned to PAYLOAD_ALIGNMENT: ``data``
    itself where it is aligned; with ``copy`` a private, writable copy; with ``readonly`` a copy in
    pages that fault on a write (aligned, as every copy here)."""
    if not nbytes or data is None:
        return torch.empty(0, dtype=torch.uint8)
    if copy:
        return aligned_copy(data, nbytes)
    if readonly:
        return read_only_copy(data, nbytes)
    # The tensor holds ``data`` (and, through a memoryview, the bytes it views) for as long as it lives.
    base = torch.frombuffer(data, dtype=torch.uint8)
    if base.data_ptr() % PAYLOAD_ALIGNMENT == 0:
        return base
    return aligned_copy(data, nbytes)


def aligned_copy(data: Buffer, nbytes: int) -> torch.Tensor:
    """A private copy of ``data`` in memory of its own that starts aligned."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    if out.data_ptr() % PAYLOAD_ALIGNMENT:  # an allocator that aligns less than torch's default
        spare = torch.empty(nbytes + PAYLOAD_ALIGNMENT - 1, dtype=torch.uint8)
        skip = -spare.data_ptr() % PAYLOAD_ALIGNMENT
        out = spare[skip : skip + nbytes]
    memoryview(out.numpy())[:] = _flat(data)
    return out


def read_only_copy(data: Buffer, nbytes: int) -> torch.Tensor:
    """A copy of ``data`` in pages a write through the tensor faults on: written through a second,
    writable mapping of the same memory, which the tensor never sees."""
    with _lock:
        chunk = _current[0]
        if nbytes > _CHUNK_BYTES // 4:
            chunk = _Chunk(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)  # its own: a chunk would hold far more
        elif chunk is None or chunk.used + nbytes > chunk.size:
            chunk = _current[0] = _next_chunk(chunk)
        at = chunk.used
        chunk.used = -(-(at + nbytes) // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT
        chunk.writable[at : at + nbytes] = _flat(data)
        # The tensor holds the read-only mapping alone; the writable one goes with the chunk, once full.
        return torch.frombuffer(chunk.readable, dtype=torch.uint8, count=nbytes, offset=at)


# Read-only copies are carved out of chunks of this size, each one memfd mapped twice (written through
# one mapping, read through the other): a mapping and its page faults per feature cost more than the
# rest of a small feature's get. A chunk's pages stay while any tensor of it lives, and a full chunk is
# carved again once none does.
_CHUNK_BYTES = 1 << 20
# The page faults of a whole chunk taken at once, in the kernel, rather than one by one on first touch.
_SHARED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _next_chunk(full: Optional["_Chunk"]) -> "_Chunk":
    """A chunk to carve from: a retired one no tensor reads any more (its pages already faulted in), or
    a new one. ``full`` joins the retired, the oldest of which is let go past _RETIRED."""
    if full is not None:
        _retired.append(full)
    for i, chunk in enumerate(_retired):
        if chunk.unread():
            del _retired[i]
            chunk.used = 0
            return chunk
    del _retired[:-_RETIRED]  # their read-only pages live on while tensors read them, then go
    return _Chunk(_CHUNK_BYTES)


class _Chunk:
    def __init__(self, size: int) -> None:
        try:
            fd = os.memfd_create("mmfeat-inline", os.MFD_CLOEXEC)
        except OSError as exc:
            raise MmfeatError(ErrorCode.INTERNAL, f"cannot make read-only pages for an inline feature ({exc}); "
                              "a readonly Client does not hand out writable views: use copy=True") from None
        try:
            os.ftruncate(fd, size)
            self.writable = mmap.mmap(fd, size, flags=_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.readable = mmap.mmap(fd, size, flags=_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # each mapping holds the memory
        self.size = size
        self.used = 0
        self._refs = sys.getrefcount(self.readable)  # this object's reference, and the call's

    def unread(self) -> bool:
        """Whether no tensor holds the read-only mapping any more (each storage made by frombuffer holds
        a reference to it): then no view can see what is written next."""
        return sys.getrefcount(self.readable) <= self._refs


_lock = threading.Lock()
_current: list[Optional[_Chunk]] = [None]
_RETIRED = 8  # full chunks kept to be carved again once their tensors are gone
_retired: list[_Chunk] = []


def _hold_for_fork() -> None:
    _lock.acquire()


def _forget_in_parent() -> None:
    # A forked child holds the tensors it inherited, over the same shared pages: a chunk carved again
    # would change them under it. Every chunk of before the fork is let go (its pages live while
    # tensors of either process read them).
    _current[0] = None
    _retired.clear()
    _lock.release()


def _forget_in_child() -> None:
    # The same in the child, whose lock may be held by a thread of the parent that is not there.
    global _lock
    _lock = threading.Lock()
    _current[0] = None
    _retired.clear()


os.register_at_fork(before=_hold_for_fork, after_in_parent=_forget_in_parent, after_in_child=_forget_in_child)


def _flat(data: Buffer) -> memoryview:
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view
