"""Can this GPU share memory as CUDA FABRIC handles? Three independent checks, all required.

The FABRIC device attribute alone lies without an IMEX channel (docs/design.md, GPU pools), so
the verdict rests on NVML's fabric state, an IMEX channel device, and a real FABRIC cycle: create,
export, import, release. Export and import fail on their own when IMEX is down or misconfigured even
where the create succeeds, which is why NCCL's MNNVL check goes through all four.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from mmfeat import cuda_driver as drv

log = logging.getLogger("mmfeatd")


@dataclass(frozen=True)
class FabricVerdict:
    ok: bool
    reason: str


def fabric_cycle_works(ordinal: int) -> tuple[bool, str]:
    """Create a granularity-sized FABRIC allocation, export it, import the exported bytes, release both."""
    created = imported = None
    step = "cuMemCreate"
    try:
        prop = drv.allocation_prop(ordinal, "fabric")
        size = drv.granularity(prop)
        created = drv.ck(step, drv.cu.cuMemCreate(size, prop, 0))
        step = "cuMemExportToShareableHandle"
        shared = drv.ck(step, drv.cu.cuMemExportToShareableHandle(created, drv.handle_type("fabric"), 0))
        step = "cuMemImportFromShareableHandle"
        imported = drv.ck(step, drv.cu.cuMemImportFromShareableHandle(bytes(shared.data), drv.handle_type("fabric")))
    except drv.CudaError as exc:
        return False, f"the FABRIC {step} failed ({exc.name}); IMEX may be down or misconfigured"
    finally:
        for handle in (imported, created):
            if handle is not None:
                drv.cu.cuMemRelease(handle)
    return True, "a FABRIC create, export and import work"


def probe_fabric(ordinal: int) -> FabricVerdict:
    """The verdict for one device; never raises."""
    reason = drv.driver_unavailable_reason()
    if reason is not None:
        return FabricVerdict(False, reason)
    passed = []
    # NVML and the IMEX channels need no context: asking them first spares a node without a fabric the
    # context (time and HBM) a retain would make on every GPU at every start.
    for check in (lambda: drv.nvml_fabric_state(ordinal), drv.imex_channel_present):
        try:
            ok, why = check()
        except Exception as exc:  # a probe must give a verdict, whatever NVML does
            ok, why = False, f"fabric probe failed: {exc}"
        if not ok:
            return FabricVerdict(False, why)
        passed.append(why)
    checks: list[Any] = [lambda: fabric_cycle_works(ordinal)]
    try:
        ctx = drv.retain_primary_context(ordinal)
    except drv.CudaError as exc:
        return FabricVerdict(False, f"cannot use CUDA device {ordinal} ({exc.name})")
    try:
        with drv.context_current(ctx):  # cuMemCreate needs a current context
            for check in checks:
                try:
                    ok, why = check()
                except Exception as exc:  # a probe must give a verdict, whatever the driver does
                    ok, why = False, f"fabric probe failed: {exc}"
                if not ok:
                    return FabricVerdict(False, why)
                passed.append(why)
        return FabricVerdict(True, ", ".join(passed))
    except drv.CudaError as exc:
        return FabricVerdict(False, f"cannot make device {ordinal}'s context current ({exc.name})")
    finally:
        drv.release_primary_context(ordinal, ctx)


def pools_fabric_domain(pools: Iterable[Any]) -> Optional[dict[str, Any]]:
    """The NVLink domain this daemon announces to its peers: the one its FABRIC pools' GPUs share, as
    ``{cluster_uuid, clique}``. None without FABRIC pools, when NVML cannot say, or when the GPUs disagree
    (no peer could then import every pool's handle)."""
    domains = set()
    for pool in pools:
        if getattr(pool, "handle", None) != "fabric":
            continue
        domain, why = drv.fabric_domain(pool.device)
        if domain is None:
            log.warning("GPU %d's NVLink domain is unknown (%s); other nodes will pull its features", pool.device, why)
            return None
        domains.add(domain)
    if len(domains) != 1:
        if domains:
            log.warning("this node's FABRIC pools are in %d NVLink domains; other nodes will pull their features",
                        len(domains))
        return None
    domain = domains.pop()
    log.info("NVLink domain: cluster %s, clique %d", domain.cluster_uuid, domain.clique)
    return {"cluster_uuid": domain.cluster_uuid, "clique": domain.clique}
