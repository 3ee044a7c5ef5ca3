"""Producer processes that run out of file descriptors, for tests/test_client_resources.py."""

from __future__ import annotations

import os
import resource
from typing import Any

import torch

from mmfeat.client import Client, MmfeatError

_LIMIT = 512  # RLIMIT_NOFILE for the worker: filling it takes a moment, and nothing else here needs more


def _leave_free(n: int) -> list[int]:
    """Open /dev/null until the fd limit is reached, then close ``n`` of them; returns those still open."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    while True:
        try:
            held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            break
    for _ in range(n):
        os.close(held.pop())
    return held


def put_with_free_fds(runtime_dir: str, free: int, connect_first: bool, out: Any) -> None:
    """One put with ``free`` fds left under the limit; sends what it returned or raised, then closes."""
    tensor = torch.ones(1 << 18)  # 1 MiB: over the inline threshold, so it would go to the pool
    client = Client(runtime_dir, timeout=2.0)
    if connect_first:
        client.connect()
    _leave_free(free)
    try:
        desc = client.put(tensor)
        result = {"inline": desc.is_inline, "fallbacks": dict(client.fallbacks),
                  "intact": bool(torch.equal(client.get(desc, copy=True), tensor))}
        client.ack(desc)
    except MmfeatError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    out.send(result)
    client.close()
