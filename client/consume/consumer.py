"""The consumer path: the tensors a descriptor names, checked against the lease table first."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional, Union

import torch

from mmfeat.protos.descriptor import Descriptor
from mmfeat.protos.errors import ErrorCode, MmfeatError, lost_read
from mmfeat.protos.messages import HoldReply, PoolInfo, RemoteGetReply

from .. import tensors as tz
from ..gpu import gpu_order, ready_word
from ..link.channel import ControlChannel
from .inline_base import inline_base
from ..link.session import Session
from ..gpu.stream_wait import DEFAULT_WAIT_S, wait_for_current_stream
from ..link.mapping import HostMapping
from .pinned import PendingCopies, pending_key, pinned_view
from ..policy import feature_staging
from ..link.lease_table import STATE_FREE, STATE_MISMATCH

log = logging.getLogger("mmfeat.client")

Tensors = Union[torch.Tensor, list[torch.Tensor]]
# A hold a staged copy could not take: the copy is made synchronously and checked after instead.
_NO_HOLD = (ErrorCode.NOT_FOUND, ErrorCode.STALE, ErrorCode.POOL_FULL, ErrorCode.OVER_QUOTA, ErrorCode.BAD_STATE)


class Consumer:
    def __init__(self, connect: Callable[[], Session], channel: ControlChannel, pending: PendingCopies,
                 let_go: Callable[[Descriptor], Any], readonly: bool = False) -> None:
        self._connect = connect
        self._readonly = readonly  # inline views too are in pages a write faults on (inline_base.py)
        self._channel = channel
        self._pending = pending  # staged copies from host pools still in flight, which their acks wait for
        # Acks a staged copy's own hold, behind that copy (the ack finds it in ``pending``).
        self._let_go = let_go

    def get(self, desc: Descriptor, copy: bool, verify: bool, device: Any, by_key: bool = False,
            stream: Any = None) -> Tensors:
        """``by_key``: ``desc`` is what a lookup by key answered, which no consumer count of this reader's
        protects (the reader may be none of the feature's consumers). ``stream``: the stream a view of a
        GPU feature is read on, which waits for its READY word (else the current stream of its device)."""
        if desc.kind == "inline":
            private = device is None and copy
            base = inline_base(desc.inline, desc.nbytes, copy=private,
                               readonly=self._readonly and device is None and not copy)
            out = [tz.view(base, spec) for spec in desc.tensors]
            return _finish(out, desc.many, False, device, DEFAULT_WAIT_S)
        session = self._connect()
        if desc.node != session.node:
            return self._remote(session, desc, copy, verify, device)
        if desc.epoch != session.epoch:
            raise MmfeatError(
                ErrorCode.STALE,
                f"descriptor is from daemon epoch {desc.epoch}, the daemon is now epoch {session.epoch}: "
                "it restarted; re-send the feature",
            )
        pool = session.pools.get(desc.pool)
        if pool is None or desc.offset + desc.nbytes > pool.size:
            raise MmfeatError(ErrorCode.FORBIDDEN, f"lease [{desc.offset}, +{desc.nbytes}) is outside pool {desc.pool}")
        if verify:  # verify(), without its frame for the common live lease
            state = session.table.state(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes)
            if state <= STATE_FREE:
                self._not_live(desc, state)
        # A host pool's mapping without the call: session.mapping looks it up the same way.
        mapping = session.mappings.get((desc.pool, -1)) if pool.kind == "host" else None
        if mapping is None:
            # A GPU pool is mapped for the device the copy goes to (or the view is read on), not for
            # whichever is current.
            on = _cuda_ordinal(device) if device is not None else stream.device_index if stream is not None else None
            mapping = session.mapping(desc.pool, on if pool.kind == "cuda" else None)
            if pool.kind == "cuda" and not session.table.is_ready(desc.lease, desc.gen):
                self._behind_ready(session, desc, mapping.device, copy or device is not None, stream)
        if device is None and not copy and not desc.many:
            return tz.pool_view(mapping.tensor, desc.offset, desc.tensors[0])  # the common get: one view
        if device is not None and pool.kind == "host" and feature_staging("host", device) == "pinned_async":
            staged = self._stage(session, mapping, desc, device, verify, by_key)
            if staged is not None:
                return staged  # nothing can end the lease before the copy has read it (_stage)
        pool = mapping.tensor
        out = _finish([tz.pool_view(pool, desc.offset, spec) for spec in desc.tensors], desc.many, copy, device,
                      session.ready_ttl)
        if verify and (copy or device is not None):
            # The lease may have ended while we copied; then the copy may hold someone else's bytes.
            self.verify(session, desc)
        return out

    def _behind_ready(self, session: Session, desc: Descriptor, ordinal: int, sync: bool, stream: Any) -> None:
        """A GPU feature its producer published behind its stream's write, not yet written. For a view,
        whatever is queued on ``stream`` (else ``ordinal``'s current stream) from here waits on the GPU
        for its READY word. A get that copies, and a view where the driver cannot wait, wait on the host
        instead, for the daemon's ``ready_ttl`` at most (client/gpu/ready_word.py): such a get waits
        anyway, and a producer whose GPU never writes is then a TIMED_OUT, not a stream stalled."""
        table = session.table
        if not sync and ready_word.wait_before(table, stream if stream is not None else torch.cuda.current_stream(
                ordinal), desc.lease, desc.gen):
            return
        try:
            ready_word.wait_on_host(table, desc.lease, desc.gen, session.ready_ttl)
        except MmfeatError as exc:
            if exc.code is ErrorCode.LOST:
                self._channel.failures.lost(f"get of lease {desc.lease} generation {desc.gen}", _key(desc))
            raise

    def _stage(self, session: Session, mapping: HostMapping, desc: Descriptor, device: Any, verify: bool,
               by_key: bool) -> Optional[Tensors]:
        """A host-pool feature copied into a GPU's memory from the pool's pinned pages, on that device's
        current stream, without waiting, so no check after the copy can run before get returns: the
        feature must stay until the copy has read it. A counted feature's consumer's share does that
        (its ack waits for the copy's event); a retained feature is held for the copy (a hold of one,
        acked behind the copy's event). None where the pool cannot be pinned, where no hold can be taken,
        and for a counted feature found by key (no share of this reader's protects it): then the caller
        copies synchronously and checks after. ``verify`` False: the caller vouches for the feature."""
        target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        ordinal = target.index if target.index is not None else torch.cuda.current_device()
        pinned = pinned_view(mapping, ordinal)
        if pinned is None:
            return None
        held = None
        if verify and session.table.retained(desc.lease, desc.gen):
            held = self._hold(session, desc)
            if held is None:
                return None
        elif verify and by_key:
            return None
        source = held if held is not None else desc
        target = torch.device("cuda", ordinal)
        try:
            with torch.cuda.device(ordinal):
                out = [tz.pool_view(pinned, desc.offset, spec).to(target, non_blocking=True) for spec in desc.tensors]
        finally:
            # Whatever was queued (all of it, or the copies before one that failed), the ack waits for
            # it. An earlier staged get of the same feature (another stream, another device) may still
            # be copying: the ack waits for both.
            fence = gpu_order.current_streams([ordinal])
            key = pending_key(source)
            fence.absorb(self._pending.take(key))
            self._pending.add(key, fence)
            if held is not None:
                self._let_go(held)
        return out if desc.many else out[0]

    def _hold(self, session: Session, desc: Descriptor) -> Optional[Descriptor]:
        """A hold of one reader on retained feature ``desc`` (the descriptor naming the hold's slot), which
        keeps its range from eviction and reuse until acked; None where the daemon takes none (the
        feature ended or is not yet published, no slot, this session's quota)."""
        try:
            reply = HoldReply.from_wire(self._channel.call("hold", session=session.token, lease=desc.lease_ref(),
                                                           count=1))
        except MmfeatError as exc:
            if exc.code in _NO_HOLD:
                return None
            raise
        ref = reply.lease
        return dataclasses.replace(desc, lease=ref.lease, gen=ref.gen, token=ref.token)

    def prefetch(self, desc: Descriptor, wait_s: Optional[float] = None) -> None:
        """Have this node's daemon start pulling another node's feature now, so that a later get() finds
        it pulled or under way; ``wait_s``: how long the pull may take (default: the call timeout).
        Nothing for this node's features and inline ones; never waits."""
        if desc.is_inline:
            return
        session = self._connect()
        if desc.node != session.node:
            self._channel.hint("remote_get", node=desc.node, lease=desc.lease_ref(),
                               wait_s=self._channel.timeout if wait_s is None else wait_s, **_into_pool(session, None))

    def hold_remote(self, desc: Descriptor, count: int, wait_s: float) -> Descriptor:
        """Another node's feature, pulled into this node's pool (or found there), held for ``count``
        readers: the hold's descriptor, which they read and ack as a feature of this node's."""
        session = self._connect()
        reply = RemoteGetReply.from_wire(self._channel.call(
            "remote_get", timeout=wait_s + self._channel.timeout, node=desc.node, lease=desc.lease_ref(),
            wait_s=wait_s, session=session.token, hold=count))
        ref = reply.lease
        return dataclasses.replace(desc, node=session.node, pool=ref.pool, epoch=ref.epoch, lease=ref.lease,
                                   gen=ref.gen, token=ref.token, offset=ref.offset)

    def _remote(self, session: Session, desc: Descriptor, copy: bool, verify: bool, device: Any) -> Tensors:
        """Another node's feature: this node's daemon pulls it into its own pool (and gives the copy's
        lease), or relays the owner's FABRIC handle; either way the read is local from then on."""
        into = _into_pool(session, device)
        reply = RemoteGetReply.from_wire(self._channel.call(
            "remote_get", node=desc.node, lease=desc.lease_ref(), wait_s=self._channel.timeout, **into))
        fabric = reply.fabric
        if fabric is not None:
            # The owner's GPU is on another node: a UUID no local GPU has keeps the import from granting
            # a local GPU of the same ordinal access as if it were the owner's.
            info = PoolInfo(fabric.pool, fabric.epoch, "cuda", fabric.device, fabric.size, fabric.handle, fabric.fabric,
                            f"remote:{desc.node}")
            try:
                pool = session.fabric_mapping(fabric.node, info).tensor
            except RuntimeError as exc:  # CudaError, PoolMapError: the handle does not import in this process
                # Same domain by NVML, yet no IMEX channel in this container (or no GPU here): the bytes
                # can still come as a pull, which the daemon counts per peer (fabric_fallbacks).
                _warn_fabric_fallback(desc.node, exc)
                reply = RemoteGetReply.from_wire(self._channel.call(
                    "remote_get", node=desc.node, lease=desc.lease_ref(), wait_s=self._channel.timeout, pull=True,
                    **into))
            else:
                out = [tz.pool_view(pool, desc.offset, spec) for spec in desc.tensors]
                return _finish(out, desc.many, copy, device, session.ready_ttl)
        copy_ref = reply.lease
        local = dataclasses.replace(desc, node=session.node, pool=copy_ref.pool, epoch=copy_ref.epoch,
                                    lease=copy_ref.lease, gen=copy_ref.gen, token=copy_ref.token,
                                    offset=copy_ref.offset)
        out = self.get(local, copy, verify, device)
        # The caller acks the owner's descriptor, not the copy's: that ack must wait for a staged copy too.
        staged = self._pending.take(pending_key(local))
        if staged is not None:
            staged.absorb(self._pending.take(pending_key(desc)))
            self._pending.add(pending_key(desc), staged)
        return out

    def verify(self, session: Session, desc: Descriptor) -> None:
        """Raise unless the lease table shows ``desc``'s lease live with exactly its pool, offset and size.
        A live lease costs no round trip; otherwise ``lookup`` asks the daemon, whose error says why
        (expired, acked, reused slot, a range that does not match)."""
        state = session.table.state(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes)
        if state <= STATE_FREE:
            self._not_live(desc, state)

    def _not_live(self, desc: Descriptor, state: int) -> None:
        """The table says STATE_FREE or STATE_MISMATCH: raise what the daemon says (LOST without asking,
        where the table marks the read lost)."""
        session = self._connect()
        try:
            if state == STATE_FREE and desc.epoch == session.epoch and session.table.lost(desc.lease, desc.gen):
                raise lost_read(desc.lease, desc.gen)
            self._channel.call("lookup", lease=desc.lease_ref())
        except MmfeatError as exc:
            if exc.code is ErrorCode.LOST:
                self._channel.failures.lost(f"get of lease {desc.lease} generation {desc.gen}", _key(desc))
            raise
        if state == STATE_MISMATCH:  # the daemon found it fine: the table is the authority on ranges
            raise MmfeatError(ErrorCode.FORBIDDEN,
                              f"lease {desc.lease}'s range in the lease table differs from the descriptor's")


_fabric_warned: set[str] = set()


def _warn_fabric_fallback(node: str, exc: Exception) -> None:
    if node not in _fabric_warned:  # once per owner node: every get of its features would say the same
        _fabric_warned.add(node)
        log.warning("node %r's FABRIC handle does not import here (%s); its features are pulled instead", node, exc)


def _into_pool(session: Session, device: Any) -> dict[str, int]:
    """remote_get's ``into_pool``: the daemon's pool on the GPU this process reads on (``device`` if it is
    a CUDA one, else the current device once CUDA is in use here), so that a node with a pool per GPU
    pulls the copy next to the rank that reads it. Nothing for host pools, or without CUDA in use:
    asking would make a context on a process that never used a GPU."""
    if not any(info.kind == "cuda" for info in session.pools.values()):
        return {}  # a host daemon: nothing to choose, and no reason to look at CUDA
    if device is not None:
        target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        ordinal = target.index if target.type == "cuda" else None
        if target.type == "cuda" and ordinal is None:
            ordinal = torch.cuda.current_device()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        ordinal = torch.cuda.current_device()
    else:
        ordinal = None
    if ordinal is None:
        return {}
    pool = session.pool_on_local_device(ordinal)
    return {"into_pool": pool.pool} if pool is not None else {}


def _cuda_ordinal(device: Any) -> Optional[int]:
    """The CUDA ordinal ``device`` names (None: not a CUDA device, or no device given)."""
    if device is None:
        return None
    target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if target.type != "cuda":
        return None
    return target.index if target.index is not None else torch.cuda.current_device()


def _key(desc: Descriptor) -> tuple[str, int, int, int]:
    return (desc.node, desc.epoch, desc.lease, desc.gen)


def _finish(views: list[torch.Tensor], many: bool, copy: bool, device: Any, wait_s: float) -> Tensors:
    if not copy and device is None:
        return views if many else views[0]  # zero-copy views: nothing to wait for
    sources = {t.device for t in views if t.is_cuda}
    if device is not None:
        target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        views = [t.to(target, copy=True) for t in views]
        if target.type == "cuda":
            sources.add(target)
    else:
        views = [t.clone() for t in views]
    # A private copy must be complete before get() returns: the caller may ack at once, and the pool
    # range can then be reused. torch queues a copy on the current stream of the source device (and,
    # across devices, may involve the target's), so finish both; TIMED_OUT after ``wait_s``.
    for dev in sources:
        wait_for_current_stream(dev, wait_s)
    return views if many else views[0]

