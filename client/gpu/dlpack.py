"""A torch tensor over memory we mapped ourselves, on an explicit device, without a copy.

``torch.as_tensor`` on ``__cuda_array_interface__`` needs NumPy and infers the device from the
pointer's attributes (for imported VMM memory that can name another GPU, and then torch copies the
whole pool). A DLPack capsule states the device outright, and its deleter keeps the owner of the
mapping alive until torch frees the last view, so the range is unmapped only after that.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch

from ..neutral import outside_inference

KDL_CPU, KDL_CUDA = 1, 2
_KDL_UINT = 1


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # takes the struct's address, as a plain int
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_CAPSULE_NAME = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# The struct torch keeps a pointer to lives on the C heap, not in a Python object: at interpreter exit
# Python clears module dicts in an order of its own, and a struct held by one would be freed while a
# tensor in another module (or in torch's) still pointed at it, so torch's deleter call read freed
# memory (SIGSEGV at exit, seen on a GPU). The deleter frees it.
_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]
_SHAPE_AT = ctypes.sizeof(_Managed)  # the one-element shape array follows the struct in the block

# What each live tensor keeps alive (the mapping's owner), by the struct's address.
_live: dict[int, Any] = {}


class _Guard:
    """The lock over ``_live``, in an object the deleter binds: the deleter cannot look it up in module
    globals (exit sets them to None), and a forked child must still be able to replace it."""

    lock = threading.Lock()


def _new_lock_in_child() -> None:
    # A thread of the parent wrapping or freeing a tensor at the fork holds the lock in the child for
    # good: the child's next get, loads or tensor release would wait for it.
    _Guard.lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _delete_impl(addr: int, live: dict[int, Any] = _live, guard: Any = _Guard, free: Any = _libc.free) -> None:
    # Everything it uses is bound here, not looked up in module globals, which exit sets to None.
    with guard.lock:
        owner = live.pop(addr, None)
    free(addr)
    del owner  # may unmap now


_delete = _Deleter(_delete_impl)
# The C thunk torch calls must outlive every tensor, so it is never freed (one leaked reference).
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_delete))


def uint8_tensor(ptr: int, nbytes: int, device_type: int, device_id: int, owner: Any) -> torch.Tensor:
    """A 1-D uint8 tensor over ``[ptr, ptr + nbytes)`` on the given DLPack device; ``owner`` is kept
    alive until torch has freed every view of it."""
    addr = _libc.malloc(_SHAPE_AT + ctypes.sizeof(ctypes.c_int64))
    if not addr:
        raise MemoryError("no memory for a DLPack tensor header")
    shape = (ctypes.c_int64 * 1).from_address(addr + _SHAPE_AT)
    shape[0] = nbytes
    managed = _Managed.from_address(addr)
    managed.dl_tensor.data = ptr
    managed.dl_tensor.device = _Device(device_type, device_id)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = ctypes.cast(addr + _SHAPE_AT, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = None  # compact
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _delete
    with _Guard.lock:
        _live[addr] = owner
    try:
        capsule = _capsule_new(addr, _CAPSULE_NAME, None)
        with outside_inference():  # it outlives this call, shared by later puts and gets: client/neutral.py
            tensor = torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _Guard.lock:
            _live.pop(addr, None)
        _libc.free(addr)  # torch did not take it, so its deleter will not run
        raise
    if tensor.data_ptr() != ptr:
        raise RuntimeError("torch copied the memory instead of viewing it")
    return tensor


def live_capsules() -> int:
    """Tensors torch has not freed yet (tests check that views release their owner)."""
    with _Guard.lock:
        return len(_live)


def keep_alive(t: torch.Tensor, owner: Any) -> torch.Tensor:
    """``t`` again, over the same memory, in a storage of its own that keeps ``owner`` alive until torch
    frees it, and with it every view, slice or reshape made from the result. An empty ``t`` views no
    memory and is returned as it is."""
    if t.numel() == 0:
        return t
    if any(s < 0 for s in t.stride()):
        raise ValueError("keep_alive needs non-negative strides")
    # The bytes from the first element to the end of the last one, whatever the strides.
    nbytes = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    if t.is_cuda:
        kind, ordinal = KDL_CUDA, t.device.index if t.device.index is not None else torch.cuda.current_device()
    elif t.device.type == "cpu":
        kind, ordinal = KDL_CPU, 0
    else:
        raise ValueError(f"keep_alive works on CPU and CUDA tensors, not {t.device.type}")
    base = uint8_tensor(t.data_ptr(), nbytes, kind, ordinal, owner)
    with outside_inference():
        return base.view(t.dtype).as_strided(t.shape, t.stride())
