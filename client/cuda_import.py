"""Import a CUDA VMM pool into this process, once per (daemon, pool, epoch, device), as a uint8 tensor.

POSIX fd or FABRIC bytes -> import -> reserve VA -> map -> set access for this process's device ->
release the imported handle (the mapping keeps the memory) -> close the fd. Per tensor there is no
driver call at all: get() slices the cached tensor.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import cuda_driver as drv

_lock = threading.Lock()
_cache: dict[tuple[str, int, int, int], "CudaMapping"] = {}


class _DeviceRange:
    """Owns one mapped VA range; exposes it through __cuda_array_interface__ so torch can wrap it.
    Tensors made from it hold a reference, so the range is unmapped only after the last view is gone."""

    def __init__(self, va: Any, size: int) -> None:
        self.va = va
        self.size = size

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # stream None: no synchronisation implied; the producer synchronised before publishing.
        return {"shape": (self.size,), "typestr": "|u1", "data": (int(self.va), False), "version": 3, "stream": None}

    def __del__(self) -> None:
        if self.va is not None and drv.cu is not None:
            try:
                drv.cu.cuMemUnmap(self.va, self.size)
                drv.cu.cuMemAddressFree(self.va, self.size)
            except Exception:
                pass  # interpreter shutdown: the process exit frees it anyway
            self.va = None


@dataclass
class CudaMapping:
    pool_id: int
    epoch: int
    size: int
    device: int
    tensor: torch.Tensor  # uint8 over the whole pool, on ``device``


def map_cuda_pool(endpoint: str, info: dict[str, Any], fd: Optional[int]) -> CudaMapping:
    """The pool described by ``info`` (from hello) mapped for the current CUDA device. Takes ownership
    of ``fd`` (a POSIX-fd pool) and closes it in every case."""
    owned, fd = fd, None  # from here on `owned` is closed exactly once, on every path
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("this process has no CUDA device, so it cannot map GPU pool %d" % info["pool"])
        reason = drv.driver_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot map GPU pool {info['pool']}: {reason}")
        device = torch.cuda.current_device()
        key = (endpoint, info["pool"], info["epoch"], device)
        with _lock:
            hit = _cache.get(key)
            if hit is not None:
                return hit
            for old in [k for k in _cache if k[0] == endpoint and k[2] != info["epoch"]]:
                del _cache[old]  # a daemon restart: the old pool goes once its last view is gone
            handle = _import_handle(info, owned)
            mapping = _map(info, handle, device)
            _cache[key] = mapping
            return mapping
    finally:
        if owned is not None:
            os.close(owned)  # cuMemImportFromShareableHandle does not take ownership of the fd


def _import_handle(info: dict[str, Any], fd: Optional[int]) -> Any:
    # torch made its primary context current on this thread; the VMM calls below use it.
    torch.cuda.init()
    torch.empty(1, device=f"cuda:{torch.cuda.current_device()}")
    if info["handle"] == "fabric":
        raw: Any = bytes(info["fabric"])
        kind = "fabric"
    else:
        if fd is None:
            raise RuntimeError(f"the daemon sent no fd for POSIX-fd pool {info['pool']}")
        raw, kind = fd, "posix_fd"
    return drv.ck("cuMemImportFromShareableHandle", drv.cu.cuMemImportFromShareableHandle(raw, drv.handle_type(kind)))


def _map(info: dict[str, Any], handle: Any, device: int) -> CudaMapping:
    """Reserve VA, map the whole allocation, grant access, release the imported handle."""
    cu = drv.cu
    size = int(info["size"])
    va = None
    mapped = False
    try:
        prop = drv.ck("cuMemGetAllocationPropertiesFromHandle", cu.cuMemGetAllocationPropertiesFromHandle(handle))
        gran = drv.granularity(prop)
        va = drv.ck("cuMemAddressReserve", cu.cuMemAddressReserve(size, gran, 0, 0))
        drv.ck("cuMemMap", cu.cuMemMap(va, size, 0, handle, 0))  # whole allocation at offset 0
        mapped = True
        drv.ck("cuMemSetAccess", cu.cuMemSetAccess(va, size, [drv.access_desc(device)], 1))
        _grant_owner_access(va, size, info, device)
    except BaseException:
        if mapped:
            cu.cuMemUnmap(va, size)
        if va is not None:
            cu.cuMemAddressFree(va, size)
        raise
    finally:
        cu.cuMemRelease(handle)  # the mapping keeps the memory alive
    holder = _DeviceRange(va, size)
    return CudaMapping(info["pool"], info["epoch"], size, device, _wrap(holder, device))


def _wrap(holder: _DeviceRange, device: int) -> torch.Tensor:
    """A uint8 tensor over the mapped range, never a copy. torch infers the device of a
    __cuda_array_interface__ pointer from its attributes, which for VMM memory may name the GPU that
    owns the allocation rather than ours; if asking for ours would copy, take what torch infers."""
    ptr = int(holder.va)
    for want in (f"cuda:{device}", None):
        tensor = torch.as_tensor(holder, device=want) if want else torch.as_tensor(holder)
        if tensor.data_ptr() == ptr:
            return tensor
    raise RuntimeError("torch copied the pool instead of wrapping it; this torch build cannot view imported VMM memory")


def _grant_owner_access(va: Any, size: int, info: dict[str, Any], device: int) -> None:
    """Best effort: also let the pool's own GPU reach this mapping, so a copy torch runs on that GPU's
    stream (a staged get from a view torch placed there) can read it. Ordinals are this process's."""
    owner = int(info.get("device", -1))
    if owner < 0 or owner == device or owner >= torch.cuda.device_count():
        return
    try:
        drv.ck("cuMemSetAccess", drv.cu.cuMemSetAccess(va, size, [drv.access_desc(owner)], 1))
    except drv.CudaError:
        pass  # no peer access between the two: staged copies go through the consumer's own device
