"""GPU work ordered on the GPU, through the driver API.

A ``Fence`` is a set of events recorded behind the work queued so far on some streams (the caller's
current streams, a stream or event it names, a staged copy's stream). Whatever gives pool memory back
(an ack, a finaliser's ack, a dropped reservation) does so only once its fence is done: recording one
never waits, and the wait happens on the acker's threads, never on the caller's.

The events are the driver's, made in the primary context of the stream's device (the context torch's
runtime uses), with BLOCKING_SYNC so that a waiter sleeps in the driver instead of spinning. A thread
that waits makes the event's context current first: a runtime call from a thread that never chose a
device would bind (and, if need be, create) GPU 0's context. Waiting threads run in relaxed capture
mode, so that their waits do not invalidate a CUDA graph another thread is capturing in global mode.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Iterable, Iterator, Optional

from mmfeat import cuda_driver as drv

# CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING, CU_STREAM_NON_BLOCKING.
_EVENT_FLAGS = 0x1 | 0x2
_NON_BLOCKING = 0x1
PUBLISH_STREAMS = 8  # streams of ours per device that write READY words behind reservations' fills

_lock = threading.Lock()
_contexts: dict[tuple[int, int], Any] = {}  # (pid, ordinal) -> the primary context, retained once
# (pid, ordinal, use) -> a driver stream of ours: "follow" follows callers' events for acks, "publish-k"
# write READY words behind reservations' fills (apart, so that none waits behind another's work).
_side: dict[tuple[int, int, str], Any] = {}
_relaxed = threading.local()
_lanes: dict[tuple[int, int, int], int] = {}  # (pid, ordinal, stream) -> its publish stream (_publish_lane)


def _new_lock_in_child() -> None:
    # A parent thread holding the lock at the fork would hold it in the child for good.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def context(ordinal: int) -> Any:
    """Device ``ordinal``'s primary context, retained once per process: only devices whose streams this
    process already uses get here, so this never makes a context torch would not have made."""
    key = (os.getpid(), ordinal)
    ctx = _contexts.get(key)
    if ctx is None:
        with _lock:
            ctx = _contexts.get(key)
            if ctx is None:
                ctx = _contexts[key] = drv.retain_primary_context(ordinal)
    return ctx


@contextlib.contextmanager
def relaxed_while() -> Iterator[None]:
    """The calling thread in relaxed capture mode for the block, and back in its own mode after: a
    driver call of ours in a caller's thread then neither breaks nor is refused for another thread's
    global-mode capture."""
    mode = drv.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = drv.ck("cuThreadExchangeStreamCaptureMode", drv.cu.cuThreadExchangeStreamCaptureMode(mode))
    try:
        yield
    finally:
        drv.cu.cuThreadExchangeStreamCaptureMode(previous)


def relaxed() -> None:
    """Put the calling thread in relaxed capture mode, once: its waits and queries are then allowed
    while another thread captures a graph in global mode, and do not invalidate that capture."""
    if getattr(_relaxed, "pid", None) == os.getpid():
        return
    mode = drv.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    drv.ck("cuThreadExchangeStreamCaptureMode", drv.cu.cuThreadExchangeStreamCaptureMode(mode))
    _relaxed.pid = os.getpid()


def _handle(stream: Any) -> tuple[int, Any]:
    """(device ordinal, CUstream) of a torch stream (or anything with ``cuda_stream`` and
    ``device_index``)."""
    return int(stream.device_index), drv.cu.CUstream(int(stream.cuda_stream))


def is_stream(obj: Any) -> bool:
    return hasattr(obj, "cuda_stream") and hasattr(obj, "device_index")


def is_event(obj: Any) -> bool:
    return hasattr(obj, "cuda_event")


def capturing(stream: Any) -> bool:
    """Whether ``stream`` is being captured into a graph: an event recorded there would become a node of
    the graph instead of marking the work done so far."""
    _, handle = _handle(stream)
    status = drv.ck("cuStreamIsCapturing", drv.cu.cuStreamIsCapturing(handle))
    return int(status) != 0


def refuse_capture(stream: Any, what: str) -> None:
    """BAD_STATE where ``stream`` (a torch stream, or anything with ``cuda_stream`` and ``device_index``)
    is being captured into a graph, or cannot say because another stream of its context is: ``what``
    must wait for the GPU, and a wait in a capture fails and invalidates it."""
    from mmfeat.protos.errors import ErrorCode, MmfeatError

    ordinal, _ = _handle(stream)
    with drv.context_current(context(ordinal)):  # the legacy stream (handle 0) is the current context's
        try:
            busy = capturing(stream)
        except drv.CudaError:
            busy = True  # the legacy stream while a blocking stream of its context captures
    if busy:
        raise MmfeatError(ErrorCode.BAD_STATE, f"{what} inside a CUDA graph capture on cuda:{ordinal}: it waits for "
                          "the GPU's work, which a capture forbids (and would be invalidated by); call it outside "
                          "the capture (put before it, or publish a reservation filled in it after it ends)")


class Fence:
    """Events behind work on some streams; done once every one is. ``devices`` are devices to
    synchronise whole instead, where no event could mark the work (a stream under capture)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, Any]] = []
        self.devices: list[int] = []
        self.lane: Optional[tuple[int, int]] = None  # (device, stream) of the first record: the acker's lane
        self.pid = os.getpid()

    def __bool__(self) -> bool:
        return bool(self.events or self.devices)

    def record(self, stream: Any) -> "Fence":
        """Mark the work queued on ``stream`` so far (a torch stream); never waits."""
        ordinal, handle = _handle(stream)
        with drv.context_current(context(ordinal)):  # the legacy stream (handle 0) is the current context's
            try:
                captured = capturing(stream)
            except drv.CudaError:  # the legacy stream while a blocking stream of its context captures
                captured = True
            if captured:
                if ordinal not in self.devices:
                    self.devices.append(ordinal)
                return self
            event = drv.ck("cuEventCreate", drv.cu.cuEventCreate(_EVENT_FLAGS))
            try:
                drv.ck("cuEventRecord", drv.cu.cuEventRecord(event, handle))
            except BaseException:
                drv.cu.cuEventDestroy(event)
                raise
        self.events.append((ordinal, event))
        if self.lane is None:
            self.lane = (ordinal, int(stream.cuda_stream))
        return self

    def follow(self, event: Any) -> "Fence":
        """Mark the work a caller's recorded event (a torch.cuda.Event) waits for: a stream of ours on
        the event's device waits for it on the GPU, and our event follows there."""
        device = getattr(event, "device", None)
        if device is None:
            return self  # never recorded: nothing to wait for
        ordinal = int(device.index if hasattr(device, "index") else device)
        side = _side_stream(ordinal)
        drv.ck("cuStreamWaitEvent", drv.cu.cuStreamWaitEvent(side.handle, drv.cu.CUevent(int(event.cuda_event)), 0))
        return self.record(side)

    def absorb(self, other: Optional["Fence"]) -> "Fence":
        """This fence waits for ``other``'s work too; ``other`` is emptied."""
        if other is not None and other is not self:
            self.events.extend(other.events)
            self.devices.extend(d for d in other.devices if d not in self.devices)
            if self.lane is None:
                self.lane = other.lane
            other.events, other.devices = [], []
        return self

    def query(self) -> bool:
        """True once all the work is done (a device to synchronise whole counts as not done)."""
        if self.devices:
            return False
        for ordinal, event in self.events:
            with drv.context_current(context(ordinal)):
                err = drv.cu.cuEventQuery(event)[0]
            if err == drv.cu.CUresult.CUDA_ERROR_NOT_READY:
                return False
            if err != drv.cu.CUresult.CUDA_SUCCESS:
                raise drv.CudaError("cuEventQuery", err)
        return True

    def wait(self) -> None:
        """Sleep until all the work is done, each event with its device's context current."""
        for ordinal, event in self.events:
            with drv.context_current(context(ordinal)):
                drv.ck("cuEventSynchronize", drv.cu.cuEventSynchronize(event))
        for ordinal in self.devices:
            with drv.context_current(context(ordinal)):
                drv.ck("cuCtxSynchronize", drv.cu.cuCtxSynchronize())
        self.close()

    def close(self) -> None:
        events, self.events, self.devices = self.events, [], []
        if self.pid != os.getpid():
            return  # a forked child's copy: the events are the parent's
        for _, event in events:
            drv.cu.cuEventDestroy(event)  # the driver frees it once its work is done

    def __del__(self, finalizing: Any = sys.is_finalizing) -> None:
        if not getattr(self, "events", None) or finalizing() or drv.cu is None:
            return
        try:
            self.close()
        except Exception:
            pass


class _SideStream:
    def __init__(self, ordinal: int, handle: Any) -> None:
        self.device_index = ordinal
        self.handle = handle
        self.cuda_stream = int(handle)


def _side_stream(ordinal: int, use: str = "follow") -> _SideStream:
    key = (os.getpid(), ordinal, use)
    with _lock:
        side = _side.get(key)
    if side is None:
        ctx = context(ordinal)
        with _lock:
            side = _side.get(key)
            if side is None:
                with drv.context_current(ctx):
                    handle = drv.ck("cuStreamCreate", drv.cu.cuStreamCreate(_NON_BLOCKING))
                side = _side[key] = _SideStream(ordinal, handle)
    return side


def joined(fence: Fence, ordinal: int) -> Optional[_SideStream]:
    """A stream of ours on device ``ordinal`` that waits, on the GPU, for all of ``fence``'s work (the
    fence is then closed): what is queued on it next runs behind that work, and the caller's streams
    gain no dependency. None where the fence must synchronise a device whole (no event marks its work)."""
    if fence.devices:
        return None
    side = _side_stream(ordinal, f"publish-{_publish_lane(ordinal, fence)}")
    with drv.context_current(context(ordinal)):
        for _, event in fence.events:
            drv.ck("cuStreamWaitEvent", drv.cu.cuStreamWaitEvent(side.handle, event, 0))
    fence.close()
    return side


def _publish_lane(ordinal: int, fence: Fence) -> int:
    """Which of a device's PUBLISH_STREAMS follows ``fence``: one per first stream the fence marks (a
    publish's after=), handed out in turn, so that fills on different streams seldom share one and a
    slow fill seldom delays another's READY word."""
    key = (os.getpid(), ordinal, fence.lane[1] if fence.lane is not None else 0)
    with _lock:
        lane = _lanes.get(key)
        if lane is None:
            if len(_lanes) >= 1024:
                _lanes.clear()  # streams come and go; a forgotten one just gets a lane again
            lane = _lanes[key] = len(_lanes) % PUBLISH_STREAMS
    return lane


def after(*waits: Any) -> Optional[Fence]:
    """One fence for every stream, event or fence in ``waits`` (None skipped); None when there is
    nothing to wait for. A TypeError names anything else."""
    fence = Fence()
    for w in waits:
        if w is None:
            continue
        if isinstance(w, Fence):
            fence.absorb(w)
        elif is_stream(w):
            fence.record(w)
        elif is_event(w):
            fence.follow(w)
        else:
            raise TypeError(f"after must be a torch.cuda.Stream or torch.cuda.Event, not {type(w).__name__}")
    return fence if fence else None


def current_streams(devices: Iterable[int]) -> Fence:
    """A fence behind the work queued so far on the current stream of each of ``devices``."""
    import torch

    fence = Fence()
    for ordinal in dict.fromkeys(devices):
        fence.record(torch.cuda.current_stream(ordinal))
    return fence


def behind_current(devices: list[int]) -> Optional[Fence]:
    """For a finaliser: a fence behind the current streams of ``devices``, or, where events cannot be
    recorded, one that synchronises those devices whole (on the acker's thread); None without devices.
    Never waits."""
    if not devices:
        return None
    try:
        return current_streams(devices)
    except Exception:
        fence = Fence()
        fence.devices = list(dict.fromkeys(devices))
        return fence
