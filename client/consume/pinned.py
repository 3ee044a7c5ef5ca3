"""Host pools pinned for a GPU consumer's staged gets.

``get(desc, device=cuda)`` of a feature in a host pool copies it into the consumer's HBM. From pageable
memory the driver bounces it through a staging buffer and the host thread waits; from page-locked
memory the copy is one DMA, queued on the consumer's current stream, and the thread goes on. So the
first such get registers the whole host mapping with the driver (``cuMemHostRegister``, once per
mapping whatever devices later gets name: PORTABLE), and the registration lasts as long as the
mapping. The feature's ack then waits for the copy's event (``ack(after=event)``), not the caller.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import OrderedDict
from typing import Any, Optional

import torch

from mmfeat import cuda_driver as drv
from mmfeat.protos.descriptor import Descriptor

from ..gpu import dlpack, stream_wait, teardown
from ..fork_locks import renew_in_child
from ..link.mapping import HostMapping

log = logging.getLogger("mmfeat.client")

# CU_MEMHOSTREGISTER_*: PORTABLE makes the pages pinned for every context of the process, not only the
# one current at registration; READ_ONLY is what a PROT_READ mapping (Client(readonly=True)) needs,
# since the driver would otherwise ask for write access to pages that refuse it.
PORTABLE, READ_ONLY = 0x01, 0x08

_lock = threading.Lock()


def _new_lock_in_child() -> None:
    # A thread of the parent registering a pool at the fork holds the lock in the child for good.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


class _Registration:
    """One cuMemHostRegister of a whole mapping and the primary-context reference it was made in. The
    pinned tensors over it keep it alive (dlpack.uint8_tensor), and it keeps the mapping's pages mapped,
    so the pages are unregistered before they can be unmapped, exactly once, after the device that may
    still be copying from them has finished."""

    def __init__(self, base: torch.Tensor, ordinal: int, ctx: Any) -> None:
        self.base: Optional[torch.Tensor] = base
        self.ptr: Optional[int] = base.data_ptr()
        self.ordinal = ordinal
        self.ctx = ctx
        # Every device a staged copy from these pages went to: PORTABLE pins them for all of them.
        self.devices: set[int] = {ordinal}
        self.pid = os.getpid()  # a forked child's copy is its parent's to unregister

    def close(self) -> None:
        if self.ptr is None or self.pid != os.getpid():
            return
        ptr, self.ptr = self.ptr, None  # first, so that no path can unregister twice
        try:
            teardown.settle(self.devices)
        except BaseException:
            drv.release_primary_context(self.ordinal, self.ctx)
            self.base = None
            raise
        teardown.unregister_host(ptr, self.ordinal, self.ctx, self.base)
        self.base = None

    def __del__(self, finalizing: Any = sys.is_finalizing) -> None:
        # At exit the process's teardown frees everything, and torch and the bindings may be half gone.
        if self.ptr is None or self.pid != os.getpid() or finalizing() or drv.cu is None:
            return  # in a forked child CUDA is unusable: a driver call could fail or hang
        ptr, self.ptr = self.ptr, None
        devices, ordinal, ctx, base = set(self.devices), self.ordinal, self.ctx, self.base
        try:
            # As a GPU pool's unmap: a collection here must not break a graph capture (teardown.py). The
            # pages stay mapped until the unregister: ``base`` goes with it.
            teardown.release(devices, lambda: teardown.settle(devices),
                             lambda: teardown.unregister_host(ptr, ordinal, ctx, base))
        except Exception:
            pass  # a garbage collection cannot report it; the process exit unpins the pages


def pinned_view(mapping: HostMapping, ordinal: int) -> Optional[torch.Tensor]:
    """The mapping's pages as a tensor the driver knows to be page-locked, registered on the first call
    (with the device ``ordinal``'s primary context current) and the same tensor afterwards. None where
    they cannot be pinned (said once per mapping): then gets copy from the pageable view, synchronously."""
    with _lock:
        if mapping.pinned is None and mapping.pin_error is None:
            try:
                mapping.pinned, mapping.pin_owner = _register(mapping, ordinal)
            except (drv.CudaError, RuntimeError) as exc:
                mapping.pin_error = str(exc)
                log.warning("host pool %d cannot be pinned (%s); staged gets from it copy synchronously",
                            mapping.pool_id, exc)
        if mapping.pin_owner is not None:
            mapping.pin_owner.devices.add(ordinal)
        return mapping.pinned


def _register(mapping: HostMapping, ordinal: int) -> tuple[torch.Tensor, "_Registration"]:
    reason = drv.driver_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    ctx = drv.retain_primary_context(ordinal)
    try:
        flags = PORTABLE
        if mapping.readonly:
            attr = drv.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
            if not drv.attribute(drv.device(ordinal), attr):
                raise RuntimeError(f"device {ordinal} cannot pin read-only host memory")
            flags |= READ_ONLY
        base = mapping.tensor
        with drv.context_current(ctx):
            drv.ck("cuMemHostRegister", drv.cu.cuMemHostRegister(base.data_ptr(), mapping.size, flags))
    except BaseException:
        drv.release_primary_context(ordinal, ctx)
        raise
    owner = _Registration(base, ordinal, ctx)
    try:
        return dlpack.uint8_tensor(base.data_ptr(), mapping.size, dlpack.KDL_CPU, 0, owner), owner
    except BaseException:
        owner.close()
        raise


Key = tuple[str, int, int, int]


def pending_key(desc: Descriptor) -> Key:
    return (desc.node, desc.epoch, desc.lease, desc.gen)


class PendingCopies:
    """Staged copies still in flight, by feature: the consumer's ``ack`` of such a feature waits for its
    copy's fence (a gpu_order.Fence) instead of freeing bytes a DMA is reading. Bounded: past ``limit``
    features never acked, the oldest is forgotten once its copy has completed. The get that passes the
    limit waits for it, with the lock held, so that no ack of it can find nothing to wait for while it
    is copying; at most ``timeout`` seconds: a copy still queued then (behind a stream that does not
    move) is kept, past the bound, and its ack still waits for it."""

    def __init__(self, limit: int = 4096, timeout: float = 5.0) -> None:
        self._events: OrderedDict[Key, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._limit = limit
        self._timeout = timeout
        self._over_said = False
        renew_in_child(self)  # a forked child's acks look here

    def add(self, key: Key, fence: Any) -> None:
        with self._lock:
            self._events[key] = fence
            self._events.move_to_end(key)
            while len(self._events) > self._limit:
                # Only completed copies may be forgotten; the oldest is the likeliest to be, and waiting
                # for it is what bounds a consumer that stages copies faster than it acks them.
                old, oldest = self._events.popitem(last=False)
                if not stream_wait.settled(oldest, self._timeout):
                    self._events[old] = oldest
                    self._events.move_to_end(old, last=False)
                    if not self._over_said:
                        self._over_said = True
                        log.warning("%d staged copies are unacked and the oldest has not run in %g s: its stream "
                                    "does not move; keeping them all until acked (ack what you read)",
                                    len(self._events), self._timeout)
                    break

    def rekey(self, old: Key, new: Key) -> None:
        with self._lock:
            event = self._events.pop(old, None)
            if event is not None:
                self._events[new] = event

    def take(self, key: Key) -> Optional[Any]:
        """The event an ack of ``key`` must wait for, once; None when no staged copy of it is pending."""
        with self._lock:
            return self._events.pop(key, None)

    def take_for(self, desc: Descriptor) -> Optional[Any]:
        """``take(pending_key(desc))``, without the key or the lock where nothing is pending: every ack
        asks, and only consumers that stage copies to a GPU have any."""
        if not self._events:
            return None  # a copy staged by this consumer's get was added before its ack asks
        return self.take(pending_key(desc))

    def __len__(self) -> int:
        return len(self._events)
