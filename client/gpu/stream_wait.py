"""Waiting until GPU work is done: never without a bound, never spinning a core through a long wait.

``Stream.synchronize()`` spins: the CUDA runtime's default for a process with more cores than GPUs.
When processes share a GPU without MPS their contexts take turns on it, and a wait that spans another
process's turn burns its whole length in CPU, several times what put, get and ack cost in one process
(docs/gpu.md). So a wait polls the work's events for a short while, which a copy on an idle GPU
finishes within, and then sleeps in a blocking event's ``cuEventSynchronize``.

The driver's wait has no timeout, and the work waited for may never finish: a stream queued behind
another process's READY word that nobody writes (its producer's GPU faulted, or it died with its
daemon). So the sleep happens on a sleeper thread of this module, and the caller waits for the sleeper
at most its bound and then raises TIMED_OUT; a sleeper whose work never ends stays asleep, and the next
wait takes another (at most MAX_SLEEPERS; past that a wait polls). A wait that must keep its fence when
it gives up (the fence is still needed later) polls instead: ``settled``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Optional

import torch

from mmfeat.protos.errors import ErrorCode, MmfeatError

from . import gpu_order

# Long enough for a copy of a feature's size to finish while polling, short enough that a long wait
# sleeps instead of spinning a core another process sharing the GPU needs (docs/gpu.md).
SPIN_S = 50e-6
# Sleepers whose work has not ended (stuck behind a word nobody writes) are not reused: past this many
# at once a wait polls instead of starting another thread.
MAX_SLEEPERS = 32
_POLL_FIRST_S, _POLL_MAX_S = 20e-6, 1e-3
# The bound of a wait no daemon's ready_ttl applies to (an inline feature's copy, a reservation that
# fell back to a plain tensor): the setting's default.
DEFAULT_WAIT_S = 60.0


class _Job:
    __slots__ = ("fence", "done", "error")

    def __init__(self, fence: Any) -> None:
        self.fence = fence
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


_jobs: "queue.SimpleQueue[_Job]" = queue.SimpleQueue()
_lock = threading.Lock()
_idle = 0  # sleepers waiting for a job (reserved ones excluded)
_sleepers = 0


def _new_in_child() -> None:
    # The parent's sleepers do not exist in a forked child, and a parent thread may have held the lock.
    global _jobs, _lock, _idle, _sleepers
    _jobs, _lock, _idle, _sleepers = queue.SimpleQueue(), threading.Lock(), 0, 0


os.register_at_fork(after_in_child=_new_in_child)


def _sleep_on(jobs: "queue.SimpleQueue[_Job]") -> None:
    global _idle
    gpu_order.relaxed()  # its waits must not invalidate another thread's global-mode graph capture
    while True:
        job = jobs.get()
        try:
            job.fence.wait()  # closes the fence once its work is done
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            job.error = exc
        job.done.set()
        with _lock:
            _idle += 1


def _hand(job: _Job) -> bool:
    """Give ``job`` to an idle sleeper, or a new one; False when MAX_SLEEPERS are all busy."""
    global _idle, _sleepers
    with _lock:
        if _idle:
            _idle -= 1
            start = False
        elif _sleepers < MAX_SLEEPERS:
            _sleepers += 1
            start = True
        else:
            return False
        jobs = _jobs
    jobs.put(job)
    if start:
        threading.Thread(target=_sleep_on, args=(jobs,), name="mmfeat-gpu-sleeper", daemon=True).start()
    return True


def timed_out(what: str, timeout: float) -> MmfeatError:
    return MmfeatError(ErrorCode.TIMED_OUT, f"{what} did not finish within {timeout:g} s: the GPU work queued "
                       "ahead of it is stuck (a stream waiting for another process's feature that its GPU has not "
                       "written, a faulted context); look at that work, or raise the bound")


def wait_for(fence: Optional[Any], timeout: float, what: str = "the GPU work waited for", spin: float = SPIN_S) -> None:
    """Return once the work ``fence`` (a gpu_order.Fence) marks has finished: polled for ``spin``
    seconds, then slept on in the driver (its events are blocking). TIMED_OUT after ``timeout``
    seconds; the fence is then the sleeper's, closed when its work ends. A background thread passes
    ``spin`` 0: it sleeps at once, burning no core for a caller that does not wait."""
    if fence is None:
        return
    if spin > 0:
        deadline = time.perf_counter() + spin
        while not fence.query():
            if time.perf_counter() >= deadline:
                break
        else:
            fence.close()
            return
    job = _Job(fence)
    if not _hand(job):
        if not settled(fence, timeout):
            raise timed_out(what, timeout)
        return
    if not job.done.wait(timeout):
        raise timed_out(what, timeout)
    if job.error is not None:
        raise job.error


def settled(fence: Any, timeout: float) -> bool:
    """Poll ``fence`` until its work is done (True; the fence is closed) or ``timeout`` seconds passed
    (False; the fence is left as it was, still the caller's). For rare waits that must keep the fence
    when they give up: a poll every millisecond at most, no thread."""
    deadline = time.monotonic() + timeout
    pause = _POLL_FIRST_S
    while not fence.query():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)
    fence.close()
    return True


def wait_for_current_stream(device: torch.device, timeout: float) -> None:
    """Return once the work queued so far on ``device``'s current stream has finished; TIMED_OUT after
    ``timeout`` seconds."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gpu_order.refuse_capture(torch.cuda.current_stream(index), "a wait for the work queued on the current stream")
    wait_for(gpu_order.current_streams([index]), timeout, f"the work queued on cuda:{index}'s current stream")
