"""An inline feature's payload as a uint8 tensor that views of any dtype can sit on.

Every view ``get`` returns starts on a multiple of PAYLOAD_ALIGNMENT, as torch's own allocator aligns
(a misaligned complex view can end the process inside a torch kernel). A producer lays the payload out
aligned from the descriptor's first byte (protos/inline_wire.py), but the buffer a consumer receives
need not start aligned: a bytes object's data sits at an offset inside the object, a zmq Frame's
anywhere. Such a payload is copied once into aligned memory; an aligned one is viewed where it lies.

A readonly Client gets the payload in pages of its own, made read-only after the copy, as its pool
mapping is: a write into the view faults (SIGSEGV) instead of changing the bytes another consumer of
the same descriptor reads.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any, Union

import torch

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.inline_wire import PAYLOAD_ALIGNMENT

Buffer = Union[bytes, bytearray, memoryview, Any]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.restype = ctypes.c_int


def inline_base(data: Buffer, nbytes: int, *, copy: bool, readonly: bool) -> torch.Tensor:
    """A uint8 tensor of ``data``'s ``nbytes``, its first byte aligned to PAYLOAD_ALIGNMENT: ``data``
    itself where it is aligned; with ``copy`` a private, writable copy; with ``readonly`` a copy in
    pages that fault on a write."""
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
    """A copy of ``data`` in anonymous pages of its own (page-aligned), made PROT_READ once written;
    the pages go when the tensor does."""
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    pages[:nbytes] = _flat(data)
    base = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes)  # holds the mmap, which unmaps on its end
    if _libc.mprotect(base.data_ptr(), size, mmap.PROT_READ) != 0:
        err = ctypes.get_errno()
        raise MmfeatError(ErrorCode.INTERNAL, f"cannot make an inline feature's {size} B read-only (mprotect: "
                          f"errno {err}); a readonly Client does not hand out writable views: raise the "
                          "process's map count (vm.max_map_count) or use copy=True")
    return base


def _flat(data: Buffer) -> memoryview:
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view
