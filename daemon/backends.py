"""Choose and create the pools for the configured backend."""

from __future__ import annotations

import logging

from .config import Settings
from .pools import Pool, PoolCreateError
from .pools.host import HostPool

log = logging.getLogger("mmfeatd")


def create_pools(settings: Settings) -> list[Pool]:
    """The pools for ``settings.backend``; raises PoolCreateError saying what is missing."""
    size = settings.pool_mb << 20
    backend = settings.backend
    if backend in ("auto", "cuda_vmm"):
        from .pools.cuda_vmm import create_cuda_pools, cuda_unavailable_reason

        reason = cuda_unavailable_reason(settings.devices)
        if reason is None:
            pools = create_cuda_pools(settings)
            if settings.host_pool_mb:
                try:
                    pools.append(HostPool(len(pools), settings.host_pool_mb << 20))
                except BaseException:
                    for pool in pools:
                        pool.close()
                    raise
                log.info("host pool %d: %d MiB beside the GPU pools, for features made on the CPU; GPU consumers "
                         "stage them from pinned pages", len(pools) - 1, settings.host_pool_mb)
            return pools
        if backend == "cuda_vmm":
            raise PoolCreateError(f"backend cuda_vmm cannot work here: {reason}")
        log.info("backend auto chose host memory: %s", reason)
    pool = HostPool(0, size)
    log.info(
        "host pool: %d MiB of populated memfd memory shared as a POSIX FD; a full pool falls back to inline transport",
        settings.pool_mb,
    )
    return [pool]
