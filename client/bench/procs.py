"""The bench's worker processes, forked from a server that imported torch and the client once.

A spawned interpreter spends about 2 s of CPU importing those, and a bench starts a process per
consumer and producer for each consumer count, and (``--remote``) a few per mode and round. The
server itself never touches a GPU, so its children initialise CUDA as freshly spawned ones do.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from types import ModuleType

PRELOAD = ["torch", "mmfeat.client"]


def worker_context(mp: ModuleType = multiprocessing) -> multiprocessing.context.BaseContext:
    """A forkserver context of ``mp`` (``multiprocessing``, or ``torch.multiprocessing`` for its queues)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
