"""GPU teardown that garbage collection starts: unmapping a GPU pool's range, unpinning a host pool or
the lease table.

Each first waits for the GPU work that may still touch the memory (a device synchronise, or, for the
lease table, the events behind its streams' memory operations: ``when_done``), and a finaliser runs in
whatever thread a collection happens in. A synchronise from a thread in global capture mode
invalidates the graph another thread is capturing in global mode (torch.cuda.graph's default), and one
in the thread that is capturing fails and invalidates that capture. So a finaliser does neither:
``release`` runs the teardown at once with the thread in relaxed capture mode for its length, or, when
the thread is capturing on a current stream, hands it to one thread of this module that waits in relaxed
mode and tries again while the driver refuses the synchronise for a capture. What is still queued at
exit is left to the process's teardown.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable, Iterable, Optional

from mmfeat import cuda_driver as drv

from . import gpu_order

log = logging.getLogger("mmfeat.client")

# The driver's answers to a synchronise that a capture forbids: it is tried again until they stop.
_CAPTURE_ERRORS = frozenset({"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
                             "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"})
RETRY_S = 0.05
GIVE_UP_S = 600.0  # a capture that long is a stuck one: the memory then stays until the process exits

# (settle, then): settle waits for the GPU work (None), or says whether it is done (True, or False: try
# again later); then runs once it is.
Job = tuple[Callable[[], Optional[bool]], Callable[[], None]]

_queue: "queue.SimpleQueue[Job]" = queue.SimpleQueue()  # put() is safe inside a finaliser
_thread: Optional[threading.Thread] = None
_start_lock = threading.RLock()  # re-entrant: a collection inside release() may release again


def _new_in_child() -> None:
    # The parent's thread does not exist in a forked child, and its queue belongs to that thread.
    global _queue, _thread, _start_lock
    _queue, _thread, _start_lock = queue.SimpleQueue(), None, threading.RLock()


os.register_at_fork(after_in_child=_new_in_child)


def release(devices: Iterable[int], settle: Callable[[], None], then: Callable[[], None]) -> None:
    """Run ``settle`` (the synchronise that waits for the GPU work on ``devices``) and then ``then`` (the
    unmap or unregister), from a finaliser, without breaking any thread's graph capture."""
    if _capturing_here(devices):
        _later(settle, then)
        return
    previous = _exchange(drv.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        settle()
    except drv.CudaError as exc:
        if exc.name not in _CAPTURE_ERRORS:
            raise
        _later(settle, then)  # a driver that refuses it while another thread captures: once that is over
        return
    finally:
        _exchange(previous)
    then()


def when_done(devices: Iterable[int], done: Callable[[], bool], then: Callable[[], None]) -> None:
    """Run ``then`` (an unregister) once ``done()`` says the GPU work on ``devices`` that may touch the
    memory has run: now if it has, else on this module's thread, which looks again every RETRY_S (for
    GIVE_UP_S at most: the memory then stays until the process exits). Never waits, so safe in a
    finaliser; the look runs in relaxed capture mode, and not at all in a thread that is capturing."""
    if not _capturing_here(devices):
        previous = _exchange(drv.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        try:
            finished = done()
        finally:
            _exchange(previous)
        if finished:
            then()
            return
    _later(done, then)


def settle(devices: Iterable[int]) -> None:
    """Synchronise each of ``devices`` this process used: GPU work on any of them may still touch host
    pages about to be unpinned."""
    for ordinal in sorted(set(devices)):
        drv.synchronize_if_used(ordinal)


def unregister_host(ptr: int, ordinal: int, ctx: object, keep: object = None) -> None:
    """Unpin the host pages at ``ptr`` and give back the context reference they were pinned in. ``keep``
    is only held: passed by whoever unpins later, it keeps the pages mapped until this has run."""
    try:
        with drv.context_current(ctx):
            drv.cu.cuMemHostUnregister(ptr)
    finally:
        drv.release_primary_context(ordinal, ctx)
    del keep


def _capturing_here(devices: Iterable[int]) -> bool:
    """Whether this thread's current stream on one of ``devices`` (those it has used) is being captured."""
    import torch

    for ordinal in devices:
        if not drv.has_context(ordinal):
            continue
        try:
            stream = torch.cuda.current_stream(ordinal)
        except Exception:  # noqa: BLE001 - a torch that has no CUDA streams captures none
            return False
        if gpu_order.capturing(stream):
            return True
    return False


def _exchange(mode: object) -> object:
    """Set this thread's capture mode; the mode it had."""
    return drv.ck("cuThreadExchangeStreamCaptureMode", drv.cu.cuThreadExchangeStreamCaptureMode(mode))


def _later(settle: Callable[[], Optional[bool]], then: Callable[[], None]) -> None:
    global _thread
    _queue.put((settle, then))
    if _thread is None:
        with _start_lock:
            if _thread is None:
                _thread = threading.Thread(target=_run, args=(_queue,), name="mmfeat-gpu-teardown", daemon=True)
                _thread.start()


def _run(jobs: "queue.SimpleQueue[Job]") -> None:
    gpu_order.relaxed()
    waiting: list[tuple[float, float, Job]] = []  # (next try, first try, job)
    while True:
        now = time.monotonic()
        timeout = max(0.0, min(w[0] for w in waiting) - now) if waiting else None
        try:
            job = jobs.get(timeout=timeout)
            waiting.append((now, now, job))
        except queue.Empty:
            pass
        now = time.monotonic()
        due, waiting = [w for w in waiting if w[0] <= now], [w for w in waiting if w[0] > now]
        for _, first, (settle, then) in due:
            try:
                if settle() is False:
                    if now - first < GIVE_UP_S:
                        waiting.append((now + RETRY_S, first, (settle, then)))
                    else:
                        log.warning("GPU work on host memory mmfeat no longer uses has not run in %g s: the memory "
                                    "stays pinned until the process exits", GIVE_UP_S)
                    continue
            except drv.CudaError as exc:
                if exc.name in _CAPTURE_ERRORS and now - first < GIVE_UP_S:
                    waiting.append((now + RETRY_S, first, (settle, then)))
                else:
                    log.warning("GPU memory mmfeat no longer uses stays mapped until the process exits: %s", exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a teardown thread that dies leaks every later release
                log.warning("GPU memory mmfeat no longer uses stays mapped until the process exits: %s", exc)
                continue
            try:
                then()
            except Exception as exc:  # noqa: BLE001 - as above
                log.debug("a GPU teardown failed: %s", exc)
