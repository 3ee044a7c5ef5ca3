"""Which transport a server should use for multimodal features: a pure function of what it asked for,
the node's topology and whether the model opted in. The tiers are SGLang's (shared/seed, PR #33936).

- ``cpu`` asked for: inline.
- auto on one node with CUDA: the pool, shared as a POSIX fd.
- auto on several nodes with an MNNVL fabric, an IMEX channel and an opted-in model: the pool, shared
  as a CUDA FABRIC handle. Not opted in, no IMEX channel, or no fabric: inline, and the log says which.
- ``cuda_vmm`` asked for: validated; TransportConfigError when it cannot work, never a silent fallback.

Within the pool, where a feature lives (``feature_pool``) follows where it was made: a tensor already on
a GPU goes to that GPU's pool; one made on the CPU (an image processor's pixel values) goes to the host
pool on one node, and each GPU consumer stages it from there (``feature_staging``) with one DMA from
pinned pages, so the producer never touches a GPU for it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from mmfeat.cuda_driver import IMEX_CHANNELS
from mmfeat.protos.messages import PoolInfo

log = logging.getLogger("mmfeat.policy")

REQUESTS = ("auto", "cpu", "cuda_vmm")
_logged: set[tuple[str, Optional[str], str]] = set()


def forget_logged() -> None:
    """Log every decision again, as if this process had made none yet (for tests of the log)."""
    _logged.clear()


class TransportConfigError(ValueError):
    """The requested transport cannot work on this deployment."""


@dataclass(frozen=True)
class Topology:
    cuda: bool
    nnodes: int
    mnnvl_fabric: bool
    imex_channel: bool


@dataclass(frozen=True)
class TransportDecision:
    transport: str  # "pool" or "inline"
    handle: Optional[str]  # "posix_fd", "fabric" or None
    reason: str


def supports_cuda_vmm_feature_transport(model_cls: Any) -> bool:
    """The model's opt-in: a class attribute ``supports_cuda_vmm_feature_transport = True``."""
    return bool(getattr(model_cls, "supports_cuda_vmm_feature_transport", False))


def _nvml_fabric_completed(ordinal: int) -> bool:
    """NVML fabric state COMPLETED with a non-zero cluster UUID on this process's CUDA device
    ``ordinal``, found by PCI bus id (NVML's own index ignores CUDA_VISIBLE_DEVICES)."""
    from mmfeat import cuda_driver as drv

    if drv.driver_unavailable_reason() is not None:
        return False
    try:
        return drv.nvml_fabric_state(ordinal)[0]
    except Exception:
        return False


def detect_topology(nnodes: Optional[int] = None) -> Topology:
    """What this node has: CUDA devices, node count (argument, else ``$MMFEAT_NNODES``, else 1), NVML
    fabric state, and the IMEX channel device."""
    from mmfeat import cuda_driver as drv

    ordinal = 0
    try:
        import torch

        cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
        if cuda:
            ordinal = torch.cuda.current_device()
    except Exception:
        cuda = False
    if nnodes is None:
        nnodes = int(os.environ.get("MMFEAT_NNODES", "1"))
    return Topology(
        cuda=cuda,
        nnodes=nnodes,
        mnnvl_fabric=cuda and _nvml_fabric_completed(ordinal),
        imex_channel=drv.imex_channel_present()[0],
    )


def _decide(requested: str, topo: Topology, model_opt_in: bool) -> TransportDecision:
    if requested not in REQUESTS:
        raise TransportConfigError(f"unknown transport {requested!r}; choose one of {', '.join(REQUESTS)}")
    if requested == "cpu":
        return TransportDecision("inline", None, "cpu transport requested")
    multi = topo.nnodes > 1
    if requested == "cuda_vmm":
        if not topo.cuda:
            raise TransportConfigError("cuda_vmm transport needs a CUDA device, and this node has none; use cpu")
        if not multi:
            return TransportDecision("pool", "posix_fd", "cuda_vmm requested on a single node: POSIX FD sharing")
        if not topo.mnnvl_fabric:
            raise TransportConfigError(
                f"cuda_vmm across {topo.nnodes} nodes needs a multi-node NVLink (MNNVL) fabric, "
                "and NVML reports none; use cpu"
            )
        if not topo.imex_channel:
            raise TransportConfigError(
                f"cuda_vmm across nodes needs an IMEX channel in {IMEX_CHANNELS}; configure the MNNVL compute domain "
                "(ComputeDomain on Kubernetes) or use cpu"
            )
        return TransportDecision("pool", "fabric",
                                 "cuda_vmm requested on a multi-node MNNVL domain: CUDA FABRIC sharing")
    # auto
    if not topo.cuda:
        return TransportDecision("inline", None, "no CUDA device on this node")
    if not multi:
        return TransportDecision("pool", "posix_fd", "single-node CUDA: POSIX FD sharing. Pass cpu to opt out.")
    if topo.mnnvl_fabric and topo.imex_channel:
        if model_opt_in:
            return TransportDecision(
                "pool", "fabric", "multi-node GB200/GB300 MNNVL: CUDA FABRIC sharing. Pass cpu to opt out."
            )
        return TransportDecision("inline", None, "the model has not opted into CUDA VMM transport")
    if topo.mnnvl_fabric:
        return TransportDecision(
            "inline",
            None,
            "GB200/GB300 was detected but no IMEX channel is mounted. Configure the MNNVL compute domain or "
            "pass cuda_vmm after doing so.",
        )
    return TransportDecision("inline", None, f"{topo.nnodes} nodes without an MNNVL fabric: features travel inline")


def resolve_transport(requested: str, topology: Topology, model_opt_in: bool) -> TransportDecision:
    """The transport for ``requested`` ("auto", "cpu" or "cuda_vmm") on ``topology``; logs the decision
    once per distinct outcome."""
    decision = _decide(requested, topology, model_opt_in)
    key = (decision.transport, decision.handle, decision.reason)
    if key not in _logged:
        _logged.add(key)
        log.info("multimodal feature transport resolved to %s%s: %s", decision.transport,
                 f" ({decision.handle})" if decision.handle else "", decision.reason)
    return decision


def feature_pool(pools: list[PoolInfo], gpu_pool: Optional[PoolInfo]) -> PoolInfo:
    """The pool a producer puts a feature in. ``pools``: the daemon's pools (pool_info); ``gpu_pool``: the
    pool on the GPU the tensor is on, None for a CPU tensor (or a GPU without a pool). A CPU tensor goes
    to a host pool where the daemon has one and no FABRIC pool (one node: consumers stage it with a DMA
    each, the producer copies nothing into HBM); across nodes the FABRIC pool lets other nodes map it."""
    if gpu_pool is not None:
        return gpu_pool
    if not any(p.kind == "cuda" and p.handle == "fabric" for p in pools):
        host = next((p for p in pools if p.kind == "host"), None)
        if host is not None:
            return host
    return pools[0]


def feature_staging(pool_kind: str, device: Any) -> str:
    """How ``get(desc, device=device)`` makes its copy of a feature in a ``pool_kind`` pool:
    "pinned_async" (a host-pool feature to a GPU: one DMA from the registered pages, on the current
    stream, the ack deferred to its event) or "sync" (anything else: copied, then waited for)."""
    if pool_kind != "host" or device is None:
        return "sync"
    if isinstance(device, int):
        return "pinned_async"
    kind = device.type if hasattr(device, "type") else str(device).split(":", 1)[0]
    return "pinned_async" if kind == "cuda" else "sync"
