"""The CUDA driver API through cuda-python, the NVLink fabric checks (NVML, IMEX channels), and the
checks that say why they cannot be used here.

Shared by the daemon (pools) and the client (imports), so it lives in the top package that both may
import (the daemon never imports client/); imports nothing from torch. Importing this module
never fails: a missing package or driver is reported by ``driver_unavailable_reason()``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

try:  # cuda-bindings 12.8+ and 13.x
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - cuda-python 12.x before the split
    try:
        from cuda import cuda as cu  # type: ignore[no-redef]
    except ImportError:
        cu = None  # type: ignore[assignment]


class CudaError(RuntimeError):
    """A driver call failed; the message names the call and the CUresult."""

    def __init__(self, call: str, result: Any) -> None:
        name = _error_name(result)
        super().__init__(f"{call} failed: {name}")
        self.call = call
        self.result = result
        self.name = name


def _error_name(result: Any) -> str:
    try:
        err, name = cu.cuGetErrorName(result)
        return name.decode() if err == cu.CUresult.CUDA_SUCCESS else str(result)
    except Exception:
        return str(result)


def ck(call: str, ret: Any) -> Any:
    """Unpack a binding's ``(CUresult, *values)`` tuple, raising CudaError on failure."""
    err, *vals = ret
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(call, err)
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else tuple(vals)


_init_lock = threading.Lock()
_init_error: Optional[str] = None
_initialized = False


def _new_lock_in_child() -> None:
    # A thread of the parent inside cuInit at the fork holds the lock in the child for good, and every
    # GPU call of the child asks driver_unavailable_reason first.
    global _init_lock
    _init_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def driver_unavailable_reason() -> Optional[str]:
    """None when cuInit succeeds; otherwise what is missing, in words an operator can act on."""
    global _initialized, _init_error
    with _init_lock:
        if _initialized:
            return None
        if _init_error is not None:
            return _init_error
        if cu is None:
            _init_error = ("the cuda-python package is not installed "
                           "(pip install cuda-python nvidia-ml-py: mmfeat's [cuda] extra)")
            return _init_error
        try:
            ck("cuInit", cu.cuInit(0))
        except CudaError as exc:
            _init_error = f"the CUDA driver failed to initialise ({exc.name})"
            return _init_error
        except RuntimeError as exc:
            # cuda-pathfinder raises a RuntimeError subclass when libcuda.so is absent.
            _init_error = f"no CUDA driver (libcuda) on this machine: {exc}"
            return _init_error
        _initialized = True
        return None


def device_count() -> int:
    return ck("cuDeviceGetCount", cu.cuDeviceGetCount())


def device(ordinal: int) -> Any:
    return ck("cuDeviceGet", cu.cuDeviceGet(ordinal))


def attribute(dev: Any, attr: Any) -> int:
    return ck("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(attr, dev))


def retain_primary_context(ordinal: int) -> Any:
    """Retain the device's primary context (the one torch's runtime uses) and return it. It is not made
    current: callers make it current only around their VMM calls (``context_current``), because a
    thread's current context belongs to its user, whose next runtime call runs in whatever is current."""
    return ck("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device(ordinal)))


def release_primary_context(ordinal: int, ctx: Any = None) -> None:
    """Undo one retain_primary_context; call it exactly once per retain. Releasing the last reference
    destroys the context, and with it everything any library in the process had on that device; if
    that context ``ctx`` is then still current on this thread it is unset, since the thread's next
    driver call would fail on it. A context someone else still holds stays current."""
    dev = device(ordinal)
    cu.cuDevicePrimaryCtxRelease(dev)
    if ctx is None:
        return
    err, now = cu.cuCtxGetCurrent()
    if err == cu.CUresult.CUDA_SUCCESS and int(now) == int(ctx) and not has_context(ordinal):
        cu.cuCtxSetCurrent(cu.CUcontext(0))


@contextmanager
def context_current(ctx: Any) -> Iterator[None]:
    """Make ``ctx`` current on this thread for the block, then restore whatever was current before,
    as a device guard does (the VMM calls take no context argument, but need one current)."""
    before = ck("cuCtxGetCurrent", cu.cuCtxGetCurrent())
    switch = int(before) != int(ctx)
    if switch:
        ck("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    try:
        yield
    finally:
        if switch:
            cu.cuCtxSetCurrent(before)


def has_context(ordinal: int) -> bool:
    """Whether the device's primary context exists in this process: asking does not create one, while
    synchronising a device (torch.cuda.synchronize, a retain) would, at hundreds of MiB of HBM."""
    _flags, active = ck("cuDevicePrimaryCtxGetState", cu.cuDevicePrimaryCtxGetState(device(ordinal)))
    return bool(active)


def synchronize_if_used(ordinal: int) -> None:
    """Wait for the work queued on the device's primary context, if this process has one; a device it
    never used has no work to wait for."""
    if not has_context(ordinal):
        return
    ctx = retain_primary_context(ordinal)
    try:
        with context_current(ctx):
            ck("cuCtxSynchronize", cu.cuCtxSynchronize())
    finally:
        release_primary_context(ordinal, ctx)


def device_uuid(ordinal: int) -> str:
    """The GPU's UUID as nvidia-smi prints it (GPU-xxxxxxxx-...): the same in every process, whatever
    CUDA_VISIBLE_DEVICES renumbers."""
    raw = bytes(ck("cuDeviceGetUuid", cu.cuDeviceGetUuid(device(ordinal))).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_uuid_to_local: dict[str, Optional[int]] = {}


def local_ordinal(pool_info: dict[str, Any]) -> Optional[int]:
    """gpu_ordinal of a pool info map as hello sends it."""
    return gpu_ordinal(pool_info.get("uuid"), pool_info.get("device"))


def gpu_ordinal(uuid: Optional[str], device: Optional[int]) -> Optional[int]:
    """This process's ordinal of the GPU ``uuid`` (a pool's), or None if it is not visible here. Without
    a UUID (an older daemon) the daemon's ordinal ``device`` is taken as ours."""
    if not uuid:
        return device
    if uuid not in _uuid_to_local:
        found = None
        if driver_unavailable_reason() is None:
            for ordinal in range(device_count()):
                if device_uuid(ordinal) == uuid:
                    found = ordinal
                    break
        _uuid_to_local[uuid] = found
    return _uuid_to_local[uuid]


def handle_type(kind: str) -> Any:
    t = cu.CUmemAllocationHandleType
    return t.CU_MEM_HANDLE_TYPE_FABRIC if kind == "fabric" else t.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def allocation_prop(ordinal: int, kind: str, rdma: bool = False) -> Any:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    # One handle type per allocation: the Python enum rejects POSIX|FABRIC (docs/design.md, GPU pools).
    prop.requestedHandleTypes = handle_type(kind)
    if rdma:
        # Without it a NIC cannot register the allocation for GPUDirect RDMA (NIXL over InfiniBand).
        prop.allocFlags.gpuDirectRDMACapable = 1
    return prop


def rdma_capable(ordinal: int) -> bool:
    """Whether the device supports GPUDirect RDMA on VMM allocations (only then may they ask for it)."""
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    return bool(attribute(device(ordinal), attr))


def rdma_writes_need_flush(ordinal: int) -> bool:
    """Whether a NIC's GPUDirect RDMA writes into this device's memory need cuFlushGPUDirectRDMAWrites
    before kernels on every device see them (they are ordered for all only at ALL_DEVICES), and the
    device can flush from the host."""
    attrs = cu.CUdevice_attribute
    ordering = attribute(device(ordinal), attrs.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING)
    options = attribute(device(ordinal), attrs.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS)
    all_devices = int(cu.CUGPUDirectRDMAWritesOrdering.CU_GPU_DIRECT_RDMA_WRITES_ORDERING_ALL_DEVICES)
    host = int(cu.CUflushGPUDirectRDMAWritesOptions.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST)
    return int(ordering) < all_devices and bool(int(options) & host)


def flush_rdma_writes() -> None:
    """Block until GPUDirect RDMA writes to the current context are visible to every device."""
    ck("cuFlushGPUDirectRDMAWrites", cu.cuFlushGPUDirectRDMAWrites(
        cu.CUflushGPUDirectRDMAWritesTarget.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
        cu.CUflushGPUDirectRDMAWritesScope.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES))


def granularity(prop: Any) -> int:
    flags = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(ck("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(prop, flags)))


def access_desc(ordinal: int, readonly: bool = False) -> Any:
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = ordinal
    flags = cu.CUmemAccess_flags
    d.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return d


IMEX_CHANNELS = Path("/dev/nvidia-caps-imex-channels")
# Test-only stand-ins for what a machine without an NVLink fabric cannot show: NVML's fabric answer
# ("<32 hex digits of cluster UUID>:<clique id>", state COMPLETED) and the IMEX channel directory.
TEST_ONLY_FABRIC_ENV = "MMFEAT_TEST_ONLY_FABRIC"
TEST_ONLY_IMEX_ENV = "MMFEAT_TEST_ONLY_IMEX_CHANNELS"


@dataclass(frozen=True)
class FabricDomain:
    """Where a GPU sits in a multi-node NVLink fabric: only GPUs with the same cluster UUID and clique id
    reach each other's memory through FABRIC handles (NCCL groups MNNVL peers by exactly these two)."""

    cluster_uuid: str  # 32 lowercase hex digits, never all zero
    clique: int


def _fabric_info(ordinal: int) -> tuple[int, bytes, int]:
    """NVML's (state, cluster UUID bytes, clique id) for the CUDA device ``ordinal``; raises on failure."""
    fake = os.environ.get(TEST_ONLY_FABRIC_ENV)
    if fake:
        uuid, _, clique = fake.partition(":")
        return 3, bytes.fromhex(uuid), int(clique or 0)
    import pynvml

    pynvml.nvmlInit()
    try:
        # NVML numbers devices ignoring CUDA_VISIBLE_DEVICES; the PCI bus id is the same in both.
        bus_id = ck("cuDeviceGetPCIBusId", cu.cuDeviceGetPCIBusId(32, device(ordinal)))
        bus_id = bus_id.split(b"\0")[0].decode() if isinstance(bus_id, bytes) else str(bus_id)
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        info = pynvml.c_nvmlGpuFabricInfoV_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        return int(info.state), bytes(info.clusterUuid), int(info.cliqueId)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def nvml_fabric_state(ordinal: int) -> tuple[bool, str]:
    """NVML fabric state COMPLETED with a non-zero cluster UUID for the CUDA device ``ordinal``."""
    domain, why = fabric_domain(ordinal)
    return domain is not None, why


def fabric_domain(ordinal: int) -> tuple[Optional[FabricDomain], str]:
    """The device's fabric domain when NVML reports its fabric COMPLETED with a non-zero cluster UUID,
    else None; and why, in words."""
    if not os.environ.get(TEST_ONLY_FABRIC_ENV):
        try:
            import pynvml  # noqa: F401
        except ImportError:
            return None, "nvidia-ml-py is not installed, so the NVLink fabric state is unknown"
    try:
        state, uuid, clique = _fabric_info(ordinal)
    except Exception as exc:
        return None, f"NVML reports no GPU fabric for device {ordinal} ({exc})"
    if state != 3:  # NVML_GPU_FABRIC_STATE_COMPLETED
        return None, f"NVML fabric state is {state}, not COMPLETED (3)"
    if len(uuid) != 16 or not any(uuid):
        return None, "NVML fabric is COMPLETED but the cluster UUID is zero"
    return FabricDomain(uuid.hex(), clique), "NVML fabric COMPLETED"


def imex_channel_present(channels: Optional[Path] = None) -> tuple[bool, str]:
    """Any IMEX channel this user can open (a ComputeDomain may hand a pod channel N, not channel0)."""
    if channels is None:
        channels = Path(os.environ.get(TEST_ONLY_IMEX_ENV) or IMEX_CHANNELS)
    found = sorted(channels.glob("channel*")) if channels.is_dir() else []
    if not found:
        return False, f"no IMEX channel in {channels}: configure the MNNVL compute domain"
    usable = [c for c in found if os.access(c, os.R_OK | os.W_OK)]
    if not usable:
        return False, f"{', '.join(str(c) for c in found)} exist(s) but this user cannot open any"
    return True, f"IMEX channel {usable[0].name} present"
