"""READY words: a GPU feature published behind its stream's write, and read behind it (SPEC.md §5).

The lease table, host memory every client maps, has a READY word per slot. A producer that publishes
without waiting for its copy has its stream write the feature's generation there behind the copy
(``cuStreamWriteValue64``) and publishes at once; a consumer's stream waits for the word to reach the
generation (``cuStreamWaitValue64``, GEQ) ahead of whatever reads the view. Neither thread waits. The
table is registered with the driver once per process and table (``cuMemHostRegister``, PORTABLE |
DEVICEMAP) on the first such use, which gives the device address the streams use; it is unregistered
once the table's mapping is dropped, after every device that used it has synchronised.

Every function here answers False where it cannot do its part (no driver, a device without 64-bit
stream memory operations, a stream being captured into a graph, a registration the driver refused):
the caller then waits on the host, as a producer without READY words does.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from mmfeat import cuda_driver as drv
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.lease_table import GEN_MASK

from . import gpu_order, teardown

log = logging.getLogger("mmfeat.client")

# CU_MEMHOSTREGISTER_*: PORTABLE pins the pages for every context of the process; DEVICEMAP gives them
# a device address; READ_ONLY is what a PROT_READ mapping (a message-path client) needs.
_PORTABLE, _DEVICEMAP, _READ_ONLY = 0x01, 0x02, 0x08
_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0, the table's own comparison
# A host wait for a READY word sleeps this long at most between looks.
_POLL_MAX_S = 1e-3

_lock = threading.Lock()
_supported: dict[tuple[int, int], bool] = {}  # (pid, ordinal) -> 64-bit stream memory operations


def _new_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def supported(ordinal: int) -> bool:
    """Whether device ``ordinal``'s streams can write and wait on 64-bit words (asked once)."""
    key = (os.getpid(), ordinal)
    known = _supported.get(key)
    if known is None:
        try:
            attr = drv.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
            known = drv.driver_unavailable_reason() is None and bool(drv.attribute(drv.device(ordinal), attr))
        except (drv.CudaError, RuntimeError, AttributeError):
            known = False
        _supported[key] = known
    return known


class _Registration:
    """The lease table's mapping pinned for the GPUs: the device address of its first byte per device,
    and the context reference it was registered in. It holds the mapping, so that the pages are
    unregistered before they can be unmapped."""

    def __init__(self, mm: Any, writable: bool, ordinal: int) -> None:
        self.mm = mm
        self.size = len(mm)
        view = np.frombuffer(mm, dtype=np.uint8)
        self.ptr: Optional[int] = int(view.ctypes.data)
        del view  # a live export would keep the mapping from ever closing
        self.ordinal = ordinal
        self.ctx = drv.retain_primary_context(ordinal)
        flags = _PORTABLE | _DEVICEMAP | (0 if writable else _READ_ONLY)
        try:
            with drv.context_current(self.ctx):
                drv.ck("cuMemHostRegister", drv.cu.cuMemHostRegister(self.ptr, self.size, flags))
        except BaseException:
            drv.release_primary_context(ordinal, self.ctx)
            self.ptr = None
            raise
        self.devices: dict[int, int] = {}  # ordinal -> device address of the table's first byte
        self.pid = os.getpid()

    def device_address(self, ordinal: int) -> int:
        address = self.devices.get(ordinal)
        if address is None:
            with drv.context_current(gpu_order.context(ordinal)):
                address = int(drv.ck("cuMemHostGetDevicePointer", drv.cu.cuMemHostGetDevicePointer(self.ptr, 0)))
            self.devices[ordinal] = address
        return address

    def __del__(self, finalizing: Any = sys.is_finalizing) -> None:
        if self.ptr is None or self.pid != os.getpid() or finalizing() or drv.cu is None:
            return  # at exit, or in a forked child: the process's teardown unpins the pages
        ptr, self.ptr = self.ptr, None
        devices, ordinal, ctx, mm = set(self.devices) | {self.ordinal}, self.ordinal, self.ctx, self.mm
        try:
            # A stream may still be about to write or read a word: wait for every device that used the
            # table first, without breaking a graph capture (teardown.py); ``mm`` stays mapped until then.
            teardown.release(devices, lambda: teardown.settle(devices),
                             lambda: teardown.unregister_host(ptr, ordinal, ctx, mm))
        except Exception:
            pass  # a garbage collection cannot report it; the process exit unpins the pages


_REFUSED = object()  # table.gpu of a table the driver would not register: asked once, said once


def _registration(table: Any, ordinal: int) -> Optional[_Registration]:
    reg = table.gpu
    if reg is None:
        with _lock:
            reg = table.gpu
            if reg is None:
                try:
                    with gpu_order.relaxed_while():  # it must not break another thread's graph capture
                        reg = _Registration(table.mm, table.writable, ordinal)
                except (drv.CudaError, RuntimeError, ValueError, TypeError) as exc:
                    log.warning("the lease table cannot be pinned for GPU streams (%s); GPU features are "
                                "published and read after host waits instead", exc)
                    reg = _REFUSED
                table.gpu = reg
    return reg if isinstance(reg, _Registration) else None


def _address(table: Any, stream: Any, slot: int) -> Optional[tuple[int, Any]]:
    """(device address of ``slot``'s READY word, CUstream) for queuing on ``stream``; None where the
    stream cannot (see the module's doc)."""
    ordinal, handle = int(stream.device_index), drv.cu.CUstream(int(stream.cuda_stream))
    if not supported(ordinal):
        return None
    with drv.context_current(gpu_order.context(ordinal)):
        if gpu_order.capturing(stream):
            return None  # it would become a node of the graph, replayed for other features
    reg = _registration(table, ordinal)
    if reg is None:
        return None
    return reg.device_address(ordinal) + table.ready_offset(slot), handle


def write_after(table: Any, stream: Any, slot: int, gen: int) -> bool:
    """Queue on ``stream``, behind the work that wrote the feature, the store of ``gen`` in ``slot``'s
    READY word; False where it cannot (then the caller waits for the write and stores READY itself)."""
    return table.writable and _queue("cuStreamWriteValue64", table, stream, slot, gen, 0)


def wait_before(table: Any, stream: Any, slot: int, gen: int) -> bool:
    """Make ``stream`` wait, ahead of what the caller queues next, until ``slot``'s READY word reaches
    ``gen``: True once queued, or at once if it has; False where it cannot (then wait on the host)."""
    return table.is_ready(slot, gen) or _queue("cuStreamWaitValue64", table, stream, slot, gen, _GEQ)


def _queue(call: str, table: Any, stream: Any, slot: int, gen: int, flags: int) -> bool:
    """Queue stream memory operation ``call`` on ``slot``'s READY word; False where the stream cannot."""
    where = _address(table, stream, slot)
    if where is None:
        return False
    address, handle = where
    ordinal = int(stream.device_index)
    try:
        with drv.context_current(gpu_order.context(ordinal)):
            drv.ck(call, getattr(drv.cu, call)(handle, address, gen & GEN_MASK, flags))
    except drv.CudaError as exc:  # a driver that refuses host memory here: the host waits from now on
        log.warning("device %d refused %s on the lease table (%s); GPU features there are published and "
                    "read after host waits instead", ordinal, call, exc)
        _supported[(os.getpid(), ordinal)] = False
        return False
    return True


def wait_on_host(table: Any, slot: int, gen: int, timeout: float) -> None:
    """Return once ``slot``'s READY word reaches ``gen`` (its producer's GPU wrote the feature, or the
    daemon ended it), sleeping between looks; TIMEOUT after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = 20e-6
    while not table.is_ready(slot, gen):
        if time.monotonic() >= deadline:
            raise MmfeatError(ErrorCode.TIMED_OUT, f"lease {slot}'s bytes were not ready within {timeout:g} s: its "
                              "producer's GPU has not finished writing them; retry, or look at that producer")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
