"""A torch tensor over memory we mapped ourselves, on an explicit device, without a copy.

``torch.as_tensor`` on ``__cuda_array_interface__`` needs NumPy and infers the device from the
pointer's attributes (for imported VMM memory that can name another GPU, and then torch copies the
whole pool). A DLPack capsule states the device outright, and its deleter keeps the owner of the
mapping alive until torch frees the last view, so the range is unmapped only after that.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

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


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_CAPSULE_NAME = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# What each live capsule needs kept alive (its structs, the shape array, the mapping's owner), by the
# address torch hands back to the deleter.
_live: dict[int, tuple[Any, ...]] = {}
_lock = threading.Lock()


@_Deleter
def _delete(managed: Any) -> None:
    with _lock:
        _live.pop(ctypes.addressof(managed.contents), None)  # drops the owner: it may unmap now


def uint8_tensor(ptr: int, nbytes: int, device_type: int, device_id: int, owner: Any) -> torch.Tensor:
    """A 1-D uint8 tensor over ``[ptr, ptr + nbytes)`` on the given DLPack device; ``owner`` is kept
    alive until torch has freed every view of it."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _Managed()
    managed.dl_tensor.data = ptr
    managed.dl_tensor.device = _Device(device_type, device_id)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None  # compact
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _delete
    with _lock:
        _live[ctypes.addressof(managed)] = (managed, shape, owner)
    try:
        capsule = _capsule_new(ctypes.addressof(managed), _CAPSULE_NAME, None)
        tensor = torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _lock:
            _live.pop(ctypes.addressof(managed), None)
        raise
    if tensor.data_ptr() != ptr:
        raise RuntimeError("torch copied the memory instead of viewing it")
    return tensor


def live_capsules() -> int:
    """Capsules whose tensors torch has not freed yet (tests check that views release their owner)."""
    with _lock:
        return len(_live)
