"""The little of torch.cuda the client's ordering code calls, for torch's CPU build, over the fake
libcuda's streams (tests/fake_cuda/fake_libcuda.c): streams are the fake driver's, so the events the
client records on them, and its waits, follow the order the fake keeps. A copy to a CUDA device
(``Tensor.to``) is queued on the current stream like the DMA it stands for, and returns an
uninitialised CPU tensor (the views may be over fake addresses); after ``land_copies()``, a copy of real
host memory (a host pool's pinned pages) reads its source when the stream reaches it, in the fake
driver's stream order (fake_copy), as the DMA would: before any event behind it completes.
A test queues GPU work that stays pending with ``launch`` and lets it finish with ``release``, and
sees a thread blocked on it with ``waiting``."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
from typing import Any, Iterator, Optional

import torch

from mmfeat import cuda_driver as drv

_lib: Optional[ctypes.CDLL] = None
_local = threading.local()
_defaults: dict[int, "Stream"] = {}
_contexts: dict[int, Any] = {}
_copies = itertools.count()
_lock = threading.Lock()
# Copies of host memory queued on a fake stream (fence behind the copy, source, target): kept alive until
# the fake driver has run them, since it reads the source and writes the target then.
_landing: Optional[list[tuple[Any, torch.Tensor, torch.Tensor]]] = None


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _context(ordinal: int) -> Any:
    """The runtime's own reference to a device's primary context, made on the device's first use."""
    with _lock:
        if ordinal not in _contexts:
            retained = drv.cu.cuDevicePrimaryCtxRetain(drv.device(ordinal))
            _contexts[ordinal] = drv.ck("cuDevicePrimaryCtxRetain", retained)
        return _contexts[ordinal]


class Stream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        ordinal = _ordinal(device)
        with drv.context_current(_context(ordinal)):
            self.handle = drv.ck("cuStreamCreate", drv.cu.cuStreamCreate(0))
        self.cuda_stream = int(self.handle)
        self.device_index = ordinal
        self.device = torch.device("cuda", ordinal)

    def __repr__(self) -> str:
        return f"<fake stream {self.cuda_stream:#x} on cuda:{self.device_index}>"


def _ordinal(device: Any) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return current_device() if index is None else index


def current_device() -> int:
    return getattr(_local, "device", 0)


def set_device(d: Any) -> None:
    _local.device = _ordinal(d)


@contextlib.contextmanager
def device(d: Any) -> Iterator[None]:
    before = current_device()
    set_device(d)
    try:
        yield
    finally:
        _local.device = before


def current_stream(d: Any = None) -> Stream:
    ordinal = _ordinal(d)
    chosen = getattr(_local, "streams", {}).get(ordinal)
    if chosen is not None:
        return chosen
    with _lock:
        default = _defaults.get(ordinal)
    if default is None:
        default = Stream(ordinal)
        with _lock:
            default = _defaults.setdefault(ordinal, default)
    return default


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[None]:
    if not hasattr(_local, "streams"):
        _local.streams = {}
    before = _local.streams.get(s.device_index)
    _local.streams[s.device_index] = s
    try:
        with device(s.device_index):
            yield
    finally:
        if before is None:
            _local.streams.pop(s.device_index, None)
        else:
            _local.streams[s.device_index] = before


def launch(s: Stream, tag: str) -> None:
    """GPU work on ``s`` that stays queued until ``release(tag)``."""
    assert lib().fake_launch(ctypes.c_void_p(s.cuda_stream), tag.encode()) == 0


def release(tag: str) -> int:
    released = lib().fake_release(tag.encode())
    land()
    return released


def land_copies() -> None:
    """From here on, a copy of host memory to a device reads its source once the stream has run it
    (``release`` of the work before it, or at once on an idle stream), not when it is queued: what a
    consumer's tensor then holds is what the pool held when the DMA ran. Only for sources in real
    memory: a GPU pool's view here is a fake address."""
    global _landing
    _landing = []


def land() -> None:
    """Forget the landing copies the fake driver has run by now (their bytes are in place)."""
    if _landing is None:
        return
    with _lock:
        _landing[:] = [item for item in _landing if not item[0].query()]


def pending(s: Stream) -> int:
    return lib().fake_stream_pending(ctypes.c_void_p(s.cuda_stream))


def waiting() -> int:
    """How many threads of this process wait on the host for GPU work (a synchronize) right now."""
    return lib().fake_waiting()


def begin_capture(s: Stream, mode: int = 0) -> None:
    drv.ck("cuStreamBeginCapture", drv.cu.cuStreamBeginCapture(s.handle, drv.cu.CUstreamCaptureMode(mode)))


def end_capture(s: Stream) -> str:
    err, _ = drv.cu.cuStreamEndCapture(s.handle)
    return "ok" if err == drv.cu.CUresult.CUDA_SUCCESS else drv._error_name(err)


_real_to = torch.Tensor.to


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    target = args[0] if args else kwargs.get("device")
    if isinstance(target, (int, str, torch.device)) and not isinstance(target, bool):
        dev = torch.device("cuda", target) if isinstance(target, int) else torch.device(target)
        if dev.type == "cuda":
            tag = f"copy-{next(_copies)}"
            s = current_stream(dev.index)
            out = torch.empty_like(self)  # unread without land_copies: a GPU pool view here is a fake address
            if _landing is not None and self.is_cpu and self.is_contiguous():
                from mmfeat.client.gpu import gpu_order

                nbytes = self.numel() * self.element_size()
                assert lib().fake_copy(ctypes.c_void_p(s.cuda_stream), ctypes.c_void_p(out.data_ptr()),
                                       ctypes.c_void_p(self.data_ptr()), ctypes.c_size_t(nbytes), tag.encode()) == 0
                land()
                with _lock:
                    _landing.append((gpu_order.Fence().record(s), self, out))
                return out
            launch(s, tag)
            lib().fake_release(tag.encode())  # done once what was queued before it on the stream is
            return out
    return _real_to(self, *args, **kwargs)


def install() -> None:
    """torch.cuda as a process with GPUs 0 and 1 would see it."""
    cuda: Any = torch.cuda
    cuda.is_available = lambda: True
    cuda.is_initialized = lambda: True
    cuda.device_count = lambda: 2
    cuda.current_device = current_device
    cuda.set_device = set_device
    cuda.device = device
    cuda.Stream = Stream
    cuda.current_stream = current_stream
    cuda.stream = stream
    cuda.synchronize = lambda d=None: _context(_ordinal(d))
    torch.Tensor.to = _to  # type: ignore[method-assign]
