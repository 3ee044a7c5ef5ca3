"""Waiting until a CUDA stream's queued work is done, without spinning a core through a long wait.

``Stream.synchronize()`` spins: the CUDA runtime's default for a process with more cores than GPUs.
When processes share a GPU without MPS their contexts take turns on it, and a wait that spans another
process's turn burns its whole length in CPU, several times what put, get and ack cost in one process
(docs/gpu.md). A put or a staged copy must still wait (the bytes must be there before a descriptor
exists, or before get() returns), so this polls a recorded event for a short while, which a copy on an
idle GPU finishes within, and then sleeps in a blocking event's ``synchronize()``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from . import gpu_order

# Long enough for a copy of a feature's size to finish while polling, short enough that a long wait
# sleeps instead of spinning a core another process sharing the GPU needs (docs/gpu.md).
SPIN_S = 50e-6


def wait_for(fence: Optional[Any]) -> None:
    """Return once the work ``fence`` (a gpu_order.Fence) marks has finished: polled for SPIN_S, then
    slept on in the driver (its events are blocking)."""
    if fence is None:
        return
    deadline = time.perf_counter() + SPIN_S
    while not fence.query():
        if time.perf_counter() >= deadline:
            fence.wait()
            return
    fence.close()


def wait_for_current_stream(device: torch.device) -> None:
    """Return once the work queued so far on ``device``'s current stream has finished."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    wait_for(gpu_order.current_streams([index]))
