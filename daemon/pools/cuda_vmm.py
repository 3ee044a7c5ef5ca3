"""GPU pool: one cuMemCreate allocation per device, shared as a POSIX fd (one node) or a CUDA FABRIC
handle (the nodes of one NVLink/IMEX domain).

The daemon never touches feature bytes, so it needs only the physical handle and its exported form;
it maps the allocation only for NIXL, when a mesh runs (map_for_pulls). Clients import, reserve VA,
map and set access for their own device.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from mmfeat import cuda_driver as drv

from ..config import Settings
from .base import Pool, PoolCreateError
from .fabric_probe import probe_fabric

log = logging.getLogger("mmfeatd")


def cuda_unavailable_reason(devices: list[int]) -> Optional[str]:
    """None when every configured device can hold a CUDA VMM pool shared as a POSIX fd; else why not."""
    reason = drv.driver_unavailable_reason()
    if reason is not None:
        return reason
    try:
        count = drv.device_count()
        if count == 0:
            return "the CUDA driver sees no device"
        for ordinal in devices:
            if ordinal >= count:
                return f"device {ordinal} is not present (the driver sees {count})"
            dev = drv.device(ordinal)
            attrs = drv.cu.CUdevice_attribute
            if not drv.attribute(dev, attrs.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED):
                return f"device {ordinal} does not support CUDA virtual memory management"
            if not drv.attribute(dev, attrs.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED):
                return f"device {ordinal} cannot export POSIX fd handles"
    except drv.CudaError as exc:
        return f"querying CUDA devices failed ({exc})"
    return None


class CudaVmmPool(Pool):
    kind = "cuda"

    def __init__(self, pool_id: int, ordinal: int, nbytes: int, handle: str) -> None:
        self.pool_id = pool_id
        self.device = ordinal
        self.handle = handle
        self.rdma = False
        self._alloc = None
        self._fd: Optional[int] = None
        self._fabric: Optional[bytes] = None
        self._va: Any = None  # the daemon's own mapping, made only for NIXL (map_for_pulls)
        self._ctx: Any = None  # this pool's reference to its GPU's primary context
        self._flush_rdma: Optional[bool] = None  # remote_writes_landed: whether NIC writes need a flush
        try:
            self.uuid = drv.device_uuid(ordinal)
            self._ctx = drv.retain_primary_context(ordinal)
            # Asked for only where the device supports it: elsewhere cuMemCreate would refuse the flag.
            self.rdma = drv.rdma_capable(ordinal)
            with drv.context_current(self._ctx):
                prop = drv.allocation_prop(ordinal, handle, rdma=self.rdma)
                gran = drv.granularity(prop)
                self.size = -(-nbytes // gran) * gran
                self._alloc = drv.ck("cuMemCreate", drv.cu.cuMemCreate(self.size, prop, 0))
                shared = drv.ck(
                    "cuMemExportToShareableHandle",
                    drv.cu.cuMemExportToShareableHandle(self._alloc, drv.handle_type(handle), 0),
                )
            if handle == "fabric":
                self._fabric = bytes(shared.data)  # CUmemFabricHandle has no buffer protocol
            else:
                self._fd = int(shared)
                os.set_inheritable(self._fd, False)
        except BaseException as exc:
            # Whatever failed (an OSError from the fd too): the exported fd alone keeps the HBM alive.
            self.close()
            if isinstance(exc, drv.CudaError):
                raise PoolCreateError(f"cannot create a {nbytes >> 20} MiB {handle} pool on GPU {ordinal}: "
                                      f"{exc}") from None
            raise

    def export_fd(self) -> Optional[int]:
        return self._fd

    def map_for_pulls(self) -> Optional[tuple[int, str, int]]:
        """The pool mapped in the daemon for NIXL to serve peers' READs (VRAM). Made only with a mesh;
        it takes no HBM beyond the pool's. The pool's context is left current on this (the daemon's)
        thread: the NIXL registration that follows needs one."""
        if self._alloc is None:
            raise RuntimeError("pool is closed")
        if self._va is None:
            cu = drv.cu
            before = drv.ck("cuCtxGetCurrent", cu.cuCtxGetCurrent())
            drv.ck("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
            va = None
            try:
                gran = drv.granularity(drv.allocation_prop(self.device, self.handle))
                va = drv.ck("cuMemAddressReserve", cu.cuMemAddressReserve(self.size, gran, 0, 0))
                drv.ck("cuMemMap", cu.cuMemMap(va, self.size, 0, self._alloc, 0))
                try:
                    drv.ck("cuMemSetAccess", cu.cuMemSetAccess(va, self.size, [drv.access_desc(self.device)], 1))
                except BaseException:
                    cu.cuMemUnmap(va, self.size)
                    raise
            except BaseException:
                if va is not None:
                    cu.cuMemAddressFree(va, self.size)
                cu.cuCtxSetCurrent(before)  # a failed map leaves the thread as it found it
                raise
            self._va = va
        return int(self._va), "VRAM", self.device

    def fabric_handle(self) -> Optional[bytes]:
        return self._fabric

    def remote_writes_landed(self) -> None:
        """GPUDirect RDMA writes are ordered for kernels on every GPU only where the device says so
        (GPU_DIRECT_RDMA_WRITES_ORDERING = ALL_DEVICES); elsewhere, as NCCL does after a receive, flush
        them to all devices: a consumer on another GPU of the node reads the pool through its own mapping.
        Asked of the device once."""
        if self._flush_rdma is None:
            with drv.context_current(self._ctx):
                self._flush_rdma = self.rdma and drv.rdma_writes_need_flush(self.device)
        if self._flush_rdma:
            with drv.context_current(self._ctx):
                drv.flush_rdma_writes()

    def close(self) -> None:
        # Physical memory is freed once every handle is released and every exported fd closed;
        # clients' mappings keep it alive until they unmap. The daemon's own (for NIXL) goes first.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._ctx is None:
            return
        err, now = drv.cu.cuCtxGetCurrent()
        if err == drv.cu.CUresult.CUDA_SUCCESS and int(now) == int(self._ctx):
            # map_for_pulls left it current for NIXL; the release below may destroy it, and a destroyed
            # context left current breaks this thread's next driver call.
            drv.cu.cuCtxSetCurrent(drv.cu.CUcontext(0))
        try:
            # This pool's own context, whatever another pool left current: the synchronise must wait
            # for this GPU's transfers, and the unmap needs a context of this device.
            with drv.context_current(self._ctx):
                if self._va is not None:
                    va, self._va = self._va, None
                    err, *_ = drv.cu.cuCtxSynchronize()  # a transfer NIXL started may still read it
                    if err != drv.cu.CUresult.CUDA_SUCCESS:
                        log.warning("GPU %d: synchronising before the pool's unmap failed (%s); unmapping anyway",
                                    self.device, drv.CudaError("cuCtxSynchronize", err).name)
                    drv.cu.cuMemUnmap(va, self.size)
                    drv.cu.cuMemAddressFree(va, self.size)
                if self._alloc is not None:
                    alloc, self._alloc = self._alloc, None
                    drv.cu.cuMemRelease(alloc)
        finally:
            ctx, self._ctx = self._ctx, None
            drv.release_primary_context(self.device, ctx)


def choose_handle(settings: Settings, ordinal: int) -> tuple[str, str]:
    """(handle kind, why) for one device: FABRIC only for a multi-node domain whose probe passes."""
    if settings.nnodes <= 1:
        return "posix_fd", "single node (nnodes = 1)"
    verdict = probe_fabric(ordinal)
    if verdict.ok:
        return "fabric", f"multi-node (nnodes = {settings.nnodes}) and {verdict.reason}"
    log.warning(
        "nnodes = %d but GPU %d cannot use FABRIC handles (%s); sharing as POSIX FD, so consumers on other "
        "nodes will receive features inline",
        settings.nnodes,
        ordinal,
        verdict.reason,
    )
    return "posix_fd", f"fabric probe failed: {verdict.reason}"


def create_cuda_pools(settings: Settings) -> list[Pool]:
    pools: list[Pool] = []
    try:
        for pool_id, ordinal in enumerate(settings.devices):
            handle, why = choose_handle(settings, ordinal)
            try:
                pool = CudaVmmPool(pool_id, ordinal, settings.pool_mb << 20, handle)
            except PoolCreateError as exc:
                if handle != "fabric":
                    raise
                # The probe passed but the real pool's export failed: still serve this node.
                log.warning("GPU %d: %s; sharing as POSIX FD instead, so consumers on other nodes will receive "
                            "features inline", ordinal, exc)
                handle, why = "posix_fd", f"the FABRIC pool failed ({exc})"
                pool = CudaVmmPool(pool_id, ordinal, settings.pool_mb << 20, handle)
            pools.append(pool)
            log.info(
                "CUDA VMM pool %d with %s sharing (%s): reserving %d MiB of HBM on GPU %d; this reduces KV cache "
                "headroom, and a full pool falls back to inline transport",
                pool_id,
                "CUDA FABRIC" if handle == "fabric" else "POSIX FD",
                why,
                pool.size >> 20,
                ordinal,
            )
    except BaseException:
        for pool in pools:
            pool.close()
        raise
    return pools
