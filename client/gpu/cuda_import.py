"""Import a CUDA VMM pool into this process, once per (daemon, pool, epoch, device), as a uint8 tensor.

POSIX fd or FABRIC bytes -> import -> reserve VA -> map -> set access for this process's device ->
release the imported handle (the mapping keeps the memory) -> close the fd. Per tensor there is no
driver call at all: get() slices the cached tensor.

The cache holds the mapped ranges weakly, as client/link/mapping.py holds host pools: the sessions using a
pool hold its CudaMapping, and every tensor over the pool holds its range. Once the last of them is gone
the range is unmapped, so a consumer that outlives its daemon does not keep that daemon's HBM allocated
(memory the restarted daemon needs).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mmfeat import cuda_driver as drv
from mmfeat.protos.messages import PoolInfo
from . import dlpack, teardown

_lock = threading.Lock()
# (pid, endpoint, pool, epoch, device, readonly) -> the mapped range, alive while anything uses it.
_cache: "weakref.WeakValueDictionary[tuple[int, str, int, int, int, bool], _DeviceRange]" = (
    weakref.WeakValueDictionary())


def _new_lock_in_child() -> None:
    # A thread of the parent importing a pool at the fork holds the lock in the child for good: the
    # child's first get of a GPU feature would wait for it.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)

# A pool that failed to map fails the same way on the next put (no IMEX channel, no peer access), and
# each attempt costs an import and its teardown, plus the producer's reserve and release around it. The
# failure is remembered for this long; after it one put tries again (the operator may have fixed it).
MAP_RETRY_S = 30.0
FABRIC_HANDLE_BYTES = 64  # CUmemFabricHandle
_failed: dict[tuple[int, str, int, int, int, bool], tuple[float, BaseException]] = {}
_import_failures = 0


def import_failures() -> int:
    """How many times this process tried to map a GPU pool and failed (remembered failures not counted)."""
    return _import_failures


def pool_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is a GPU pool this process mapped (a view from ``get``): memory torch's
    caching allocator does not own, so that ``record_stream`` keeps it for no one."""
    if t.is_cpu:
        return False
    base = t.untyped_storage().data_ptr()
    return any(r.va is not None and int(r.va) <= base < int(r.va) + r.size for r in list(_cache.values()))


class PoolMapError(RuntimeError):
    """This GPU pool failed to map in this process recently; the message says why and when it is retried."""


class _DeviceRange:
    """Owns one mapped VA range and one reference to the primary context it was mapped in. The tensors
    over it keep it alive (dlpack.uint8_tensor), so the range is unmapped only after the last view is
    gone, and then only after the GPUs that can reach it have finished their work: a kernel may still
    read it. close() gives back the range and the context reference exactly once."""

    def __init__(self, va: Any, size: int, devices: list[int], ctx: Any) -> None:
        self.va = va
        self.size = size
        self.devices = devices  # local ordinals with access; devices[0] is the one it was mapped for
        self.ctx = ctx
        # The CudaMapping over it while some session holds one: a session that asks again gets it back,
        # and one that asks after it is gone (a view outlived it) a new one over this same range.
        self.mapping: Optional["weakref.ref[CudaMapping]"] = None
        # A finalizer, not __del__: it runs once the cache's weak reference is dead, so no map_cuda_pool in
        # another thread can find a range that is being unmapped (__del__ runs while the reference lives,
        # and the unmap lets other threads run). It holds what the unmap needs, never the range itself.
        self._unmap = weakref.finalize(self, _unmap_quietly, va, size, devices, ctx, os.getpid())
        self._unmap.atexit = False  # at exit the process's teardown unmaps everything

    def close(self) -> None:
        """Unmap now, raising what the driver says (a range that could not be wrapped)."""
        self.va = None
        args = self._unmap.detach()
        if args is not None:
            _unmap(*args[2])


def _unmap(va: Any, size: int, devices: list[int], ctx: Any, pid: int) -> None:
    if pid != os.getpid():
        # A forked child's copy: the range and the context reference are its parent's, and CUDA does not
        # work in a forked child anyway.
        return
    try:
        _settle(devices, ctx)
    except BaseException:
        drv.release_primary_context(devices[0], ctx)
        raise
    _free(va, size, devices, ctx)


def _settle(devices: list[int], ctx: Any) -> None:
    with drv.context_current(ctx):
        for ordinal in devices:
            # As PyTorch does before it unmaps VMM memory; a GPU this process never used (the pool's
            # owner, granted access) has no work, and a synchronise would create a context.
            drv.synchronize_if_used(ordinal)


def _free(va: Any, size: int, devices: list[int], ctx: Any) -> None:
    try:
        with drv.context_current(ctx):
            drv.cu.cuMemUnmap(va, size)
            drv.cu.cuMemAddressFree(va, size)
    finally:
        drv.release_primary_context(devices[0], ctx)


def _unmap_quietly(va: Any, size: int, devices: list[int], ctx: Any, pid: int,
                   finalizing: Any = sys.is_finalizing) -> None:
    # Torch and the driver bindings may be half gone while the interpreter shuts down: calling them then
    # is what can crash.
    if finalizing() or drv.cu is None or pid != os.getpid():
        return
    try:
        # A collection may run in a thread that captures a CUDA graph, or while another thread does:
        # teardown.release keeps the synchronise from breaking either capture.
        teardown.release(devices, lambda: _settle(devices, ctx), lambda: _free(va, size, devices, ctx))
    except Exception:
        pass  # a garbage collection cannot report it; the process exit frees the range


@dataclass
class CudaMapping:
    pool_id: int
    epoch: int
    size: int
    device: int
    tensor: torch.Tensor  # uint8 over the whole pool, on ``device``; it keeps ``range`` mapped
    range: _DeviceRange


def _mapping_over(holder: _DeviceRange, info: PoolInfo) -> CudaMapping:
    """The CudaMapping over an already mapped range: the one a session holds, else a new tensor over the
    same memory (no driver call). Called with the lock held."""
    mapping = holder.mapping() if holder.mapping is not None else None
    if mapping is None:
        tensor = dlpack.uint8_tensor(int(holder.va), holder.size, dlpack.KDL_CUDA, holder.devices[0], holder)
        mapping = CudaMapping(info.pool, info.epoch, holder.size, holder.devices[0], tensor, holder)
        holder.mapping = weakref.ref(mapping)
    return mapping


def map_cuda_pool(endpoint: str, info: PoolInfo, fd: Optional[int], readonly: bool = False,
                  device: Optional[int] = None) -> CudaMapping:
    """The pool described by ``info`` (from hello) mapped for CUDA device ``device`` (default: the
    current one), with read-only access where ``readonly``. Takes ownership
    of ``fd`` (a POSIX-fd pool) and closes it in every case. Raises PoolMapError, without trying, while
    a failure to map the same pool here is younger than MAP_RETRY_S."""
    global _import_failures
    owned, fd = fd, None  # from here on `owned` is closed exactly once, on every path
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("this process has no CUDA device, so it cannot map GPU pool %d" % info.pool)
        reason = drv.driver_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot map GPU pool {info.pool}: {reason}")
        if device is None:
            device = torch.cuda.current_device()
        # Keyed by pid too: a forked child must import the pool itself, not reuse the parent's mapping.
        key = (os.getpid(), endpoint, info.pool, info.epoch, device, readonly)
        with _lock:
            hit = _cache.get(key)
            if hit is not None:
                return _mapping_over(hit, info)
            failed = _failed.get(key)
            if failed is not None and time.monotonic() - failed[0] < MAP_RETRY_S:
                left = MAP_RETRY_S - (time.monotonic() - failed[0])
                raise PoolMapError(f"GPU pool {info.pool} failed to map on device {device} ({failed[1]}); "
                                   f"tried again in {left:.0f} s, features go inline until then") from failed[1]
            try:
                mapping = _map_uncached(info, owned, device, readonly)
            except (RuntimeError, OSError) as exc:  # CudaError too
                _import_failures += 1
                # Its words only: the exception's traceback holds every frame it went through, the put's
                # tensor, Client and session among them, for as long as the failure is remembered.
                _failed[key] = (time.monotonic(), PoolMapError(f"{type(exc).__name__}: {exc}"))
                raise
            _failed.pop(key, None)
            for old in [k for k in _failed if k[0] != os.getpid() or (k[1] == endpoint and k[3] != info.epoch)]:
                del _failed[old]
            _cache[key] = mapping.range
            return mapping
    finally:
        if owned is not None:
            os.close(owned)  # cuMemImportFromShareableHandle does not take ownership of the fd


def _map_uncached(info: PoolInfo, fd: Optional[int], device: int, readonly: bool) -> CudaMapping:
    """Import and map the pool for ``device``; on failure nothing is left behind (context reference
    included). The VMM calls take no context but need one current: retain ours explicitly (the mapping
    keeps the reference) rather than rely on torch having made one current, and give the thread back
    the context it had."""
    ctx = drv.retain_primary_context(device)
    holder: Optional[_DeviceRange] = None
    try:
        with drv.context_current(ctx):
            handle = _import_handle(info, fd)
            holder = _map(info, handle, device, ctx, readonly)
            tensor = dlpack.uint8_tensor(int(holder.va), holder.size, dlpack.KDL_CUDA, device, holder)
    except BaseException:
        if holder is None:
            drv.release_primary_context(device, ctx)
        else:
            holder.close()  # it owns the context reference now: it alone releases it
        raise
    mapping = CudaMapping(info.pool, info.epoch, holder.size, device, tensor, holder)
    holder.mapping = weakref.ref(mapping)
    return mapping


def _import_handle(info: PoolInfo, fd: Optional[int]) -> Any:
    if info.handle == "fabric":
        raw: Any = bytes(info.fabric or b"")
        if len(raw) != FABRIC_HANDLE_BYTES:
            # The driver reads exactly that many bytes from the buffer: a shorter one is read past its end.
            raise PoolMapError(f"GPU pool {info.pool}'s FABRIC handle is {len(raw)} bytes, not "
                               f"{FABRIC_HANDLE_BYTES}: the daemon that sent it is broken or not mmfeat's")
        kind = "fabric"
    else:
        if fd is None:
            raise RuntimeError(f"the daemon sent no fd for POSIX-fd pool {info.pool}")
        raw, kind = fd, "posix_fd"
    return drv.ck("cuMemImportFromShareableHandle", drv.cu.cuMemImportFromShareableHandle(raw, drv.handle_type(kind)))


def _map(info: PoolInfo, handle: Any, device: int, ctx: Any, readonly: bool) -> _DeviceRange:
    """Reserve VA, map the whole allocation, grant access, release the imported handle. The range
    returned owns the context reference ``ctx``."""
    cu = drv.cu
    size = int(info.size)
    va = None
    mapped = False
    try:
        # Built here, not read from the imported handle (which may not say, for a remote FABRIC handle).
        gran = drv.granularity(drv.allocation_prop(device, info.handle))
        va = drv.ck("cuMemAddressReserve", cu.cuMemAddressReserve(size, gran, 0, 0))
        drv.ck("cuMemMap", cu.cuMemMap(va, size, 0, handle, 0))  # whole allocation at offset 0
        mapped = True
        drv.ck("cuMemSetAccess", cu.cuMemSetAccess(va, size, [drv.access_desc(device, readonly)], 1))
        devices = [device] + _grant_owner_access(va, size, info, device, readonly)
    except BaseException:
        if mapped:
            cu.cuMemUnmap(va, size)
        if va is not None:
            cu.cuMemAddressFree(va, size)
        raise
    finally:
        cu.cuMemRelease(handle)  # the mapping keeps the memory alive
    return _DeviceRange(va, size, devices, ctx)


def _grant_owner_access(va: Any, size: int, info: PoolInfo, device: int, readonly: bool) -> list[int]:
    """Best effort: also let the pool's own GPU reach this mapping, so that work queued on it can read
    the pool. The owner is found by UUID among this process's GPUs (ordinals differ between processes).
    Returns the extra local ordinals granted."""
    owner = drv.gpu_ordinal(info.uuid, info.device)
    if owner is None or owner == device:
        return []
    try:
        drv.ck("cuMemSetAccess", drv.cu.cuMemSetAccess(va, size, [drv.access_desc(owner, readonly)], 1))
    except drv.CudaError:
        return []  # no peer access between the two: staged copies go through the consumer's own device
    return [owner]
