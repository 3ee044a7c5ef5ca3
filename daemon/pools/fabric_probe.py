"""Can this GPU share memory as CUDA FABRIC handles? Three independent checks, all required.

The FABRIC device attribute alone lies without an IMEX channel (research/cuda_vmm.md, section 3), so
the verdict rests on NVML's fabric state, the IMEX channel device, and a real FABRIC cuMemCreate.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmfeat.client import cuda_driver as drv

IMEX_CHANNEL = Path("/dev/nvidia-caps-imex-channels/channel0")


@dataclass(frozen=True)
class FabricVerdict:
    ok: bool
    reason: str


def nvml_fabric_state(ordinal: int) -> tuple[bool, str]:
    """NVML fabric state COMPLETED with a non-zero cluster UUID for the CUDA device ``ordinal``."""
    try:
        import pynvml
    except ImportError:
        return False, "nvidia-ml-py is not installed, so the NVLink fabric state is unknown"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return False, f"NVML is unavailable ({exc})"
    try:
        # NVML numbers devices ignoring CUDA_VISIBLE_DEVICES; the PCI bus id is the same in both.
        bus_id = drv.ck("cuDeviceGetPCIBusId", drv.cu.cuDeviceGetPCIBusId(32, drv.device(ordinal)))
        bus_id = bus_id.split(b"\0")[0].decode() if isinstance(bus_id, bytes) else str(bus_id)
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        info = pynvml.c_nvmlGpuFabricInfoV_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        state = int(info.state)
        uuid = bytes(info.clusterUuid)
    except Exception as exc:
        return False, f"NVML reports no GPU fabric for device {ordinal} ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    if state != pynvml.NVML_GPU_FABRIC_STATE_COMPLETED:
        return False, f"NVML fabric state is {state}, not COMPLETED (3)"
    if not any(uuid):
        return False, "NVML fabric is COMPLETED but the cluster UUID is zero"
    return True, "NVML fabric COMPLETED"


def imex_channel_present() -> tuple[bool, str]:
    if not IMEX_CHANNEL.exists():
        return False, f"no IMEX channel at {IMEX_CHANNEL}: configure the MNNVL compute domain"
    if not os.access(IMEX_CHANNEL, os.R_OK | os.W_OK):
        return False, f"{IMEX_CHANNEL} exists but this user cannot open it"
    return True, "IMEX channel present"


def fabric_alloc_works(ordinal: int) -> tuple[bool, str]:
    """A granularity-sized FABRIC cuMemCreate, released at once."""
    try:
        prop = drv.allocation_prop(ordinal, "fabric")
        size = drv.granularity(prop)
        handle = drv.ck("cuMemCreate", drv.cu.cuMemCreate(size, prop, 0))
        drv.ck("cuMemRelease", drv.cu.cuMemRelease(handle))
    except drv.CudaError as exc:
        return False, f"a FABRIC cuMemCreate failed ({exc.name})"
    return True, "FABRIC cuMemCreate works"


def probe_fabric(ordinal: int) -> FabricVerdict:
    """The verdict for one device; never raises."""
    reason = drv.driver_unavailable_reason()
    if reason is not None:
        return FabricVerdict(False, reason)
    checks: list[Any] = [lambda: nvml_fabric_state(ordinal), imex_channel_present, lambda: fabric_alloc_works(ordinal)]
    passed = []
    try:
        drv.retain_primary_context(ordinal)  # cuMemCreate needs a current context
    except drv.CudaError as exc:
        return FabricVerdict(False, f"cannot use CUDA device {ordinal} ({exc.name})")
    try:
        for check in checks:
            try:
                ok, why = check()
            except Exception as exc:  # a probe must give a verdict, whatever the driver does
                ok, why = False, f"fabric probe failed: {exc}"
            if not ok:
                return FabricVerdict(False, why)
            passed.append(why)
        return FabricVerdict(True, ", ".join(passed))
    finally:
        drv.cu.cuDevicePrimaryCtxRelease(drv.device(ordinal))
