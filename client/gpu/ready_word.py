"""READY words: a GPU feature published behind its stream's write, and read behind it (SPEC.md §5).

The lease table, host memory every client maps, has a READY word per slot. A producer that publishes
without waiting for its copy has its stream write the feature's generation there behind the copy
(``cuStreamWriteValue64``) and publishes at once; a consumer's stream waits for the word to reach the
generation (``cuStreamWaitValue64``, GEQ) ahead of whatever reads the view. Neither thread waits. The
table is registered with the driver once per process and table (``cuMemHostRegister``, PORTABLE |
DEVICEMAP) on the first such use, which gives the device address the streams use; it is unregistered
once the table's mapping is dropped and the memory operations queued on it have run (an event per
stream behind the latest, never a device synchronise: see _Registration).

Every function here answers False where it cannot do its part (no driver, a device without 64-bit
stream memory operations, a stream being captured into a graph, a registration the driver refused):
the caller then waits on the host, as a producer without READY words does.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time
from typing import Any, Iterable, Optional

import numpy as np

from mmfeat import cuda_driver as drv
from mmfeat.protos.errors import ErrorCode, MmfeatError, lost_read
from mmfeat.protos.lease_table import GEN_MASK


from . import gpu_order, stream_wait, teardown

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
        # Said once per device: a 0 here turns READY words off for it without any error.
        log.info("device %d %s", ordinal, "writes and waits on READY words on its streams" if known else
                 "has no 64-bit stream memory operations (CAN_USE_64_BIT_STREAM_MEM_OPS is 0): its GPU features "
                 "are published and read after host waits")
    return known


class _Registration:
    """The lease table's mapping pinned for the GPUs: the device address of its first byte per device,
    and the context reference it was registered in. It holds the mapping, so that the pages are
    unregistered before they can be unmapped, and only once the streams' memory operations on them have
    run: an event per stream, recorded behind the latest one queued there (``marks``). ``waits`` are
    the (slot, generation) of GPU waits this process queued while the word was behind: what
    ``let_go`` releases when the table's daemon is gone."""

    def __init__(self, mm: Any, writable: bool, ordinal: int) -> None:
        self.mm = mm
        self.size = len(mm)
        view = np.frombuffer(mm, dtype=np.uint8)
        self.ptr: Optional[int] = int(view.ctypes.data)
        del view  # a live export would keep the mapping from ever closing
        self.ordinal = ordinal
        self.writable = writable
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
        self.lock = threading.Lock()
        self.marks: dict[tuple[int, int], Any] = {}  # (ordinal, stream) -> event behind its latest operation
        self.waits: dict[tuple[int, int], None] = {}  # (slot, generation), in the order queued
        self.busy = 0  # sleepers synchronising marks (settled): the events outlive them
        self.pid = os.getpid()
        self.locked = _lock_pages(self.ptr, self.size, ordinal)

    def device_address(self, ordinal: int) -> int:
        address = self.devices.get(ordinal)
        if address is None:
            # Relaxed, as the registration: the call must not break another thread's graph capture.
            with gpu_order.relaxed_while(), drv.context_current(gpu_order.context(ordinal)):
                address = int(drv.ck("cuMemHostGetDevicePointer", drv.cu.cuMemHostGetDevicePointer(self.ptr, 0)))
            self.devices[ordinal] = address
        return address

    def mark(self, ordinal: int, handle: Any) -> None:
        """Record this stream's event behind the operation just queued there (its device's context is
        current): the newest mark of a stream covers every earlier one, in stream order."""
        key = (ordinal, int(handle))
        with self.lock:
            event = self.marks.get(key)
            if event is None:
                event = self.marks[key] = drv.ck("cuEventCreate", drv.cu.cuEventCreate(_MARK_FLAGS))
            drv.ck("cuEventRecord", drv.cu.cuEventRecord(event, handle))

    def done(self, keys: Optional[Iterable[tuple[int, int]]] = None) -> bool:
        """Whether the latest operation queued on each stream ``keys`` names (all of them by default) has
        run. A stream whose context failed runs nothing more: it counts as done."""
        with self.lock:
            if self.busy:
                return False
            marks = [(k, self.marks[k]) for k in (self.marks if keys is None else keys) if k in self.marks]
        for (ordinal, _), event in marks:
            with drv.context_current(gpu_order.context(ordinal)):
                err = drv.cu.cuEventQuery(event)[0]
            if err == drv.cu.CUresult.CUDA_ERROR_NOT_READY:
                return False
        return True

    def waited(self, slot: int, gen: int, is_ready: Any) -> None:
        """A GPU wait on ``slot``'s word for ``gen`` was queued (the word was behind); ``is_ready``: the
        table's (passed, not kept: the table holds this, and nothing here may hold the table)."""
        with self.lock:
            self.waits[(slot, gen)] = None
            if len(self.waits) > _WAITS_KEPT:  # forget those written meanwhile: they hold no stream
                self.waits = {w: None for w in self.waits if not is_ready(*w)}

    def _close(self, ptr: int, ordinal: int, ctx: Any, mm: Any) -> None:
        with self.lock:
            marks, self.marks = list(self.marks.items()), {}
        for (ordinal_, _), event in marks:
            with drv.context_current(gpu_order.context(ordinal_)):
                drv.cu.cuEventDestroy(event)
        if self.locked:
            _libc.munlock(ctypes.c_void_p(ptr), ctypes.c_size_t(self.size))
        teardown.unregister_host(ptr, ordinal, ctx, mm)

    def __del__(self, finalizing: Any = sys.is_finalizing) -> None:
        if self.ptr is None or self.pid != os.getpid() or finalizing() or drv.cu is None:
            return  # at exit, or in a forked child: the process's teardown unpins the pages
        ptr, self.ptr = self.ptr, None
        ordinal, ctx, mm = self.ordinal, self.ctx, self.mm
        devices = set(self.devices) | {ordinal}
        try:
            # A stream may still be about to write or read a word: unpinned only once every memory
            # operation queued on the table has run (its stream's mark), on the teardown thread where
            # that takes time; ``mm`` stays mapped until then. Never a device synchronise: a stream
            # waiting on a word nobody writes would hold this thread for good.
            teardown.when_done(devices, self.done, lambda: self._close(ptr, ordinal, ctx, mm))
        except Exception:
            pass  # a garbage collection cannot report it; the process exit unpins the pages


_REFUSED = object()  # table.gpu of a table the driver would not register: asked once, said once
_MARK_FLAGS = 0x2  # CU_EVENT_DISABLE_TIMING: marks are only queried
_WAITS_KEPT = 1024
_libc = ctypes.CDLL(None, use_errno=True)
_lock_refused_said = False


def _lock_pages(ptr: int, size: int, ordinal: int) -> bool:
    """Lock the table's pages in memory: where registration does not pin (a GPU that reaches pageable
    memory through the host's page tables, as on Grace) a page the kernel moved or swapped would be
    under the GPU's polling. Harmless where registration pins. False (said once) where the memlock
    limit refuses it."""
    global _lock_refused_said
    if _libc.mlock(ctypes.c_void_p(ptr), ctypes.c_size_t(size)) == 0:
        return True
    if not _lock_refused_said:
        _lock_refused_said = True
        log.warning("the lease table cannot be locked in memory (%s; raise RLIMIT_MEMLOCK by %d KiB): where device "
                    "%d reaches host memory through the host's page tables its READY words are then pageable",
                    os.strerror(ctypes.get_errno()), -(-size // 1024), ordinal)
    return False


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


def _capturing(stream: Any) -> bool:
    """Whether ``stream`` is being captured into a graph, or cannot say: the legacy stream's answer is an
    error while a blocking stream of its context captures, and then nothing may be queued there either."""
    try:
        return gpu_order.capturing(stream)
    except drv.CudaError:
        return True


def write_after(table: Any, stream: Any, slot: int, gen: int) -> bool:
    """Queue on ``stream``, behind the work that wrote the feature, the store of ``gen`` in ``slot``'s
    READY word; False where it cannot (then the caller waits for the write and stores READY itself)."""
    return table.writable and _queue("cuStreamWriteValue64", table, stream, slot, gen, 0)


def wait_before(table: Any, stream: Any, slot: int, gen: int) -> bool:
    """Make ``stream`` wait, ahead of what the caller queues next, until ``slot``'s READY word reaches
    ``gen``: True once queued, or at once if it has; False where it cannot (then wait on the host)."""
    return table.is_ready(slot, gen) or _queue("cuStreamWaitValue64", table, stream, slot, gen, _GEQ)


def _queue(call: str, table: Any, stream: Any, slot: int, gen: int, flags: int) -> bool:
    """Queue stream memory operation ``call`` on ``slot``'s READY word, and the stream's mark behind it;
    False where the stream cannot (see the module's doc). One context switch for all of it."""
    ordinal, handle = int(stream.device_index), drv.cu.CUstream(int(stream.cuda_stream))
    if not supported(ordinal):
        return False
    with drv.context_current(gpu_order.context(ordinal)):
        if _capturing(stream):
            return False  # it would become a node of the graph, replayed for other features
        reg = _registration(table, ordinal)
        if reg is None:
            return False
        address = reg.device_address(ordinal) + table.ready_offset(slot)
        try:
            drv.ck(call, getattr(drv.cu, call)(handle, address, gen & GEN_MASK, flags))
        except drv.CudaError as exc:  # a driver that refuses host memory here: the host waits from now on
            log.warning("device %d refused %s on the lease table (%s); GPU features there are published and "
                        "read after host waits instead", ordinal, call, exc)
            _supported[(os.getpid(), ordinal)] = False
            return False
        reg.mark(ordinal, handle)
        if call == "cuStreamWaitValue64":
            reg.waited(slot, gen, table.is_ready)
    return True


def settled(table: Any, streams: Iterable[tuple[int, int]], timeout: float) -> bool:
    """Whether the memory operations queued on the table's words on ``streams`` ((ordinal, stream)
    pairs) have run, waited for ``timeout`` seconds at most: each stream's latest mark, so a close waits
    for the READY writes its session queued and for nothing else of the device. Slept on in the driver
    (stream_wait's sleeper), as any wait of ours."""
    reg = table.gpu
    if not isinstance(reg, _Registration) or reg.pid != os.getpid():
        return True
    keys = list(streams)
    if reg.done(keys):
        return True
    try:
        stream_wait.wait_for(_Marks(reg, keys), timeout, "the READY writes a closing session queued", spin=0)
    except MmfeatError:
        return False
    return True


class _Marks:
    """Some streams' marks of a registration, for stream_wait's sleeper: synchronised, never destroyed
    (the registration owns them, and is not torn down while a sleeper is on one: ``busy``)."""

    def __init__(self, reg: _Registration, keys: list[tuple[int, int]]) -> None:
        self.reg, self.keys = reg, keys

    def query(self) -> bool:
        return self.reg.done(self.keys)

    def wait(self) -> None:
        reg = self.reg
        with reg.lock:
            marks = [(k, reg.marks[k]) for k in self.keys if k in reg.marks]
            reg.busy += 1
        try:
            for (ordinal, _), event in marks:
                with drv.context_current(gpu_order.context(ordinal)):
                    drv.cu.cuEventSynchronize(event)
        finally:
            with reg.lock:
                reg.busy -= 1

    def close(self) -> None:
        pass


def let_go(table: Any) -> int:
    """Store, from the host, the generation of every GPU wait this process queued on ``table`` that its
    READY word has not reached: for a table whose daemon is gone, where nobody else will, so that no
    stream of this process waits on it for good. The number let go: each a read that was lost. A
    read-only mapping is made writable for this (the memfd is; only its size is sealed)."""
    reg = table.gpu
    if not isinstance(reg, _Registration) or reg.pid != os.getpid() or reg.ptr is None:
        return 0
    with reg.lock:
        waits, reg.waits = list(reg.waits), {}
    behind = [(slot, gen) for slot, gen in waits if not table.is_ready(slot, gen)]
    if not behind:
        return 0
    if not reg.writable:
        length = -(-reg.size // mmap.PAGESIZE) * mmap.PAGESIZE
        if _libc.mprotect(ctypes.c_void_p(reg.ptr), ctypes.c_size_t(length), mmap.PROT_READ | mmap.PROT_WRITE):
            log.warning("cannot let go %d GPU waits on a gone daemon's lease table (%s): those streams wait until "
                        "the process's CUDA work is abandoned", len(behind), os.strerror(ctypes.get_errno()))
            return 0
    for slot, gen in behind:
        ctypes.c_uint64.from_address(reg.ptr + table.ready_offset(slot)).value = gen & GEN_MASK
    return len(behind)


def wait_on_host(table: Any, slot: int, gen: int, timeout: float) -> None:
    """Return once ``slot``'s READY word reaches ``gen`` (its producer's GPU wrote the feature, or the
    daemon ended it), sleeping between looks. LOST as soon as the table marks the feature ended before
    its GPU wrote it; TIMED_OUT after ``timeout`` seconds (the daemon's ``ready_ttl``: its producer
    publishes before its GPU has run its queue, so a slow GPU is no reason to give up sooner)."""
    deadline = time.monotonic() + timeout
    pause = 20e-6
    while not table.is_ready(slot, gen):
        if table.lost(slot, gen):
            raise lost_read(slot, gen)
        if time.monotonic() >= deadline:
            raise MmfeatError(ErrorCode.TIMED_OUT, f"lease {slot}'s bytes were not ready within {timeout:g} s (the "
                              "daemon's ready_ttl): its producer's GPU has not written them; retry, or look at that "
                              "producer")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
    if table.lost(slot, gen):  # READY stored by the daemon, once it let the unwritten feature's range go
        raise lost_read(slot, gen)
