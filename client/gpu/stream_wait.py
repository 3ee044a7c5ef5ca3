"""Waiting until a CUDA stream's queued work is done, without spinning a core through a long wait.

``Stream.synchronize()`` spins: the CUDA runtime's default for a process with more cores than GPUs.
When processes share a GPU without MPS their contexts take turns on it, and a wait that spans another
process's turn burns its whole length in CPU, several times what put, get and ack cost in one process
(docs/gpu.md). A put or a staged copy must still wait (the bytes must be there before a descriptor
exists, or before get() returns), so this polls a recorded event for a short while, which a copy on an
idle GPU finishes within, and then sleeps in a blocking event's ``synchronize()``.
"""

from __future__ import annotations

import threading
import time

import torch

# Long enough for a copy of a feature's size to finish while polling, short enough that a long wait
# sleeps instead of spinning a core another process sharing the GPU needs (docs/gpu.md).
SPIN_S = 50e-6

_local = threading.local()  # an event is recorded and waited on by one thread at a time


def _event(device: int) -> torch.cuda.Event:
    events = getattr(_local, "events", None)
    if events is None:
        events = _local.events = {}
    event = events.get(device)
    if event is None:
        event = events[device] = torch.cuda.Event(blocking=True)
    return event


def wait_for_current_stream(device: torch.device) -> None:
    """Return once the work queued so far on ``device``'s current stream has finished."""
    stream = torch.cuda.current_stream(device)
    event = _event(stream.device_index)
    event.record(stream)
    deadline = time.perf_counter() + SPIN_S
    while not event.query():
        if time.perf_counter() >= deadline:
            event.synchronize()  # blocking: the thread sleeps until the GPU signals
            return
