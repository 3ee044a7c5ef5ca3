"""The producer path: place tensors in the pool and make their descriptor.

In order of preference: the session's arena (no message to the daemon), a reserved lease (one round
trip, for a feature larger than half an arena or when no arena has room), the inline fallback (bytes in
the descriptor, when the pool cannot take the feature or the daemon is gone).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from mmfeat.protos.descriptor import Descriptor
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, FdLimitError, MmfeatError
from mmfeat.protos.messages import MAX_CONSUMERS, FallbackReason, LeaseReply, PoolInfo

from . import packing
from ..link.channel import ControlChannel
from .fallbacks import FallbackTracker
from ..policy import feature_pool
from .put_in_flight import PutInFlight, new_token
from ..link.session import Session
from ..gpu import ready_word
from ..gpu.cuda_import import pool_memory
from ..gpu.stream_wait import wait_for_current_stream

_FALLBACK_ERRORS = {
    ErrorCode.POOL_FULL: FallbackReason.POOL_FULL,
    ErrorCode.TOO_LARGE: FallbackReason.TOO_LARGE,
    ErrorCode.DRAINING: FallbackReason.DRAINING,
    ErrorCode.OVER_QUOTA: FallbackReason.OVER_QUOTA,
}
# After this process found itself short of fds, puts go inline at once for this long instead of
# counting its fds (and perhaps saying hello) again on every put.
_FD_SHORT_S = 1.0


def check_consumers(consumers: object) -> None:
    """Refuse a count of consumers that is not an int from 1 to MAX_CONSUMERS before anything is placed:
    the lease table stores an int, and a float would reach it only after its feature took arena space."""
    if not isinstance(consumers, int) or isinstance(consumers, bool) or not 1 <= consumers <= MAX_CONSUMERS:
        raise ValueError(f"consumers must be an int between 1 and {MAX_CONSUMERS}, not {consumers!r}")


class Producer:
    def __init__(self, connect: Callable[[], Session], reconnect: Callable[[Session], Session], channel: ControlChannel,
                 fallbacks: FallbackTracker, inline_threshold: int, inline_max: int, fallback: str,
                 session_now: Callable[[], Optional[Session]]) -> None:
        self._connect = connect
        self._session_now = session_now  # the open session, or None: never connects (the fast path's)
        self._reconnect = reconnect
        self._channel = channel
        self._fallbacks = fallbacks
        self.inline_threshold = inline_threshold
        self.inline_max = inline_max
        self.fallback = fallback
        self._fd_short: Optional[tuple[float, FdLimitError]] = None  # until when, and why

    def put_one(self, tensor: torch.Tensor, consumers: int) -> Descriptor:
        """put() of one tensor: the common feature in one frame where it can be (see _put_now)."""
        layout = packing.layout((tensor,))
        if layout[1] >= self.inline_threshold and layout[1]:
            desc = self._put_now(tensor, consumers, layout)
            if desc is not None:
                return desc
        return self.put([tensor], consumers, False, layout)

    def _put_now(self, t: torch.Tensor, consumers: int, layout: packing.Layout) -> Optional[Descriptor]:
        """The put a server makes over and over, without the general path's objects and frames: one dense
        host tensor, in the arena that took the last feature, in a session whose pool, mapping and
        descriptor head the general path has set up. None for anything else, before anything is placed
        or sent: put then does it all, fallbacks and errors included."""
        if (type(consumers) is not int or not 1 <= consumers <= MAX_CONSUMERS or self._fallbacks.daemon_down
                or self._fd_short is not None or not packing.dense_host(t)):
            return None
        specs, nbytes = layout
        session = self._session_now()
        if session is None or session.host_target is None:
            return None
        pool, pool_tensor = session.host_target
        head = session.descriptor_heads.get((pool.pool, self._channel.endpoint))
        if head is None or session.arenas is None or not session.begin_write():
            return None
        try:
            arenas = session.arenas
            try:
                placed = arenas.place_now(pool.pool, nbytes)
            except DaemonUnavailableError as exc:  # asking for the next arena timed out: as put() would
                self._fallbacks.mark_down()
                put = PutInFlight(specs, nbytes, False, consumers, None, [t])
                return self._fallback_or_raise(put, FallbackReason.UNREACHABLE, exc)
            if placed is None:
                return None
            try:
                token = new_token()
                desc = Descriptor.of_pool(head, tensors=specs, nbytes=nbytes, many=False, lease=placed.slot,
                                          gen=placed.gen, token=token, offset=placed.offset)
                packing.copy_to_host_pool(pool_tensor, placed.offset, t, nbytes)
            except BaseException:
                arenas.abandon(placed)
                raise
            arenas.publish(placed, nbytes, consumers, token)
            return desc
        finally:
            session.end_write()

    def put(self, tensors: list[torch.Tensor], consumers: int, many: bool,
            layout: Optional[packing.Layout] = None) -> Descriptor:
        """``tensors`` placed in the pool, or inline; ``layout``: packing.layout(tensors) where the caller has it."""
        check_consumers(consumers)
        specs, nbytes = layout if layout is not None else packing.layout(tensors)
        if len(tensors) == 1:  # no generator for the common single tensor
            device = tensors[0].device.index if tensors[0].is_cuda else None
        else:
            device = next((t.device.index for t in tensors if t.is_cuda), None)
        put = PutInFlight(specs, nbytes, many, consumers, device, tensors)
        if nbytes < self.inline_threshold or nbytes == 0:
            return self._inline(put, FallbackReason.BELOW_THRESHOLD, "")
        if self._fallbacks.daemon_down:
            # Known down: inline at once instead of waiting out a timeout per put; a background probe
            # notices when it answers again.
            exc = DaemonUnavailableError(
                f"mmfeatd at {self._channel.endpoint} stopped answering; probing it once a second")
            return self._fallback_or_raise(put, FallbackReason.UNREACHABLE, exc)
        if self._fd_short is not None:
            if time.monotonic() < self._fd_short[0]:
                return self._fallback_or_raise(put, FallbackReason.FD_LIMIT, self._fd_short[1])
            self._fd_short = None
        writing: list[Session] = []  # the sessions this put counts as writing into (Session.begin_write)
        try:
            return self._put_in_pool(put, device, writing)
        finally:
            for s in writing:
                s.end_write()

    def _put_in_pool(self, put: PutInFlight, device: Optional[int], writing: list[Session]) -> Descriptor:
        try:
            session = self._writing_in(self._connect(), writing)
            pool, pool_tensor = self._target(session, device)
            if pool.kind == "cuda":
                # Mapped (or known not to map) before any lease exists: a pool that cannot be mapped here
                # costs no reserve and release round trip per put.
                try:
                    pool_tensor = self._pool_tensor(session, pool.pool, device)
                except (RuntimeError, OSError) as exc:  # CudaError and PoolMapError too
                    return self._fallback_or_raise(put, FallbackReason.MAP_FAILED, exc)
            desc = self._put_in_arena(session, pool, put, pool_tensor)
            if desc is not None:
                return desc
            asked_at = time.monotonic()
            session, reply = self._reserve(session, pool, put, writing)
        except MmfeatError as exc:
            return self.fall_back(put, exc)
        lease = reply.lease
        desc = put.descriptor(session, self._channel.endpoint, lease.pool, lease.lease, lease.gen, lease.token,
                              lease.offset)
        by_stream = False
        try:
            try:
                pool_tensor = self._pool_tensor(session, desc.pool, device)
            except (RuntimeError, OSError) as exc:  # CudaError too: no IMEX channel, no peer access, ...
                self._release_quietly(session, desc)
                return self._fallback_or_raise(put, FallbackReason.MAP_FAILED, exc)
            written_on = _write(pool_tensor, desc.offset, put, session.ready_ttl,
                                _ready_by_stream(session, pool_tensor, put, desc.lease, desc.gen))
            by_stream = written_on is not None
            if written_on is not None:
                session.ready_streams.add(written_on)
            life = reply.expires_in if reply.expires_in is not None else session.reserve_ttl
            if time.monotonic() - asked_at >= life / 2:
                # The write took half the lease's life (a reserve_ttl reloaded very short): the lease may
                # end before a pipelined publish lands, and its range go to another feature.
                return self._publish_late(session, desc, by_stream)
            # On the fd channel: in the daemon's socket buffer when this returns, so it is handled even
            # if this process dies now. Nothing waits for it (a consumer's table check and lookup accept
            # a RESERVED lease, and its ack counts early); a failure is logged when its reply is read.
            if not by_stream:
                session.table.mark_ready(desc.lease, desc.gen)
            session.publish(desc.lease_ref(), by_stream)
        except BaseException:
            give_back = True
            if by_stream:  # the range goes back: the copy queued into it must have run first
                try:
                    wait_for_current_stream(pool_tensor.device, session.ready_ttl)
                except MmfeatError:
                    give_back = False  # its stream does not move: the range stays this session's, not under it
            if give_back:
                self._release_quietly(session, desc)
            raise
        return desc

    def _put_in_arena(self, session: Session, pool: PoolInfo, put: PutInFlight,
                      pool_tensor: Optional[torch.Tensor] = None,
                      table_consumers: Optional[int] = None, keyed: bool = False) -> Optional[Descriptor]:
        """The descriptor of the feature placed and published in an arena; None to reserve instead.
        ``pool_tensor``: the pool's mapping where the caller has it already. ``table_consumers``: the
        CONSUMERS word to publish instead of the put's count (a retained feature's, which no ack reaches).
        ``keyed``: a feature a key finds is published once written, never behind its stream's READY word:
        a hold of it is a slot of its own whose word the daemon stores at once, and a reader through the
        hold would wait on nothing."""
        spot = put.place_in_arena(session, self._channel.endpoint, pool)
        if spot is None:
            return None
        placed, token, desc = spot
        arenas = session.arenas
        try:
            if pool_tensor is None:
                pool_tensor = self._pool_tensor(session, desc.pool, put.device)
            written_on = _write(pool_tensor, desc.offset, put, session.ready_ttl,
                                None if keyed else _ready_by_stream(session, pool_tensor, put, placed.slot, placed.gen))
            by_stream = written_on is not None
            if written_on is not None:
                session.ready_streams.add(written_on)
        except (RuntimeError, OSError):
            arenas.abandon(placed)
            if pool_tensor is None:  # no mapping: the reserve path meets the same failure and falls back
                return None
            raise
        except BaseException:  # anything else, an interrupt included: the slot and its range come back
            arenas.abandon(placed)
            raise
        # The payload is complete (or, on a GPU, its READY word queued behind it): the STATE store may
        # make it visible.
        arenas.publish(placed, put.nbytes, put.consumers if table_consumers is None else table_consumers, token,
                       ready=not by_stream)
        return desc

    def _target(self, session: Session, device: Optional[int]) -> tuple[PoolInfo, Optional[torch.Tensor]]:
        """The pool a feature on ``device`` goes to, and its mapping here if it is a mapped host pool. A
        session's pools and host mappings never change, so a CPU feature's are kept for the session rather
        than chosen again on every put."""
        if device is not None:
            return self._pool_for(session, device), None
        cached = session.host_target
        if cached is not None:
            return cached
        pool = self._pool_for(session, None)
        mapping = session.mappings.get((pool.pool, -1)) if pool.kind == "host" else None
        tensor = mapping.tensor if mapping is not None else None
        if tensor is not None:
            session.host_target = (pool, tensor)
        return pool, tensor

    def _pool_for(self, session: Session, device: Optional[int]) -> PoolInfo:
        gpu_pool = session.pool_on_local_device(device) if device is not None else None
        return feature_pool(list(session.pools.values()), gpu_pool)

    def _pool_tensor(self, session: Session, pool_id: int, device: Optional[int]) -> torch.Tensor:
        """The whole pool as a uint8 tensor; a GPU pool mapped (once) on the producer tensor's device."""
        if device is None:
            return session.mapping(pool_id).tensor
        with torch.cuda.device(device):
            return session.mapping(pool_id, device).tensor

    def _writing_in(self, session: Session, writing: list[Session]) -> Session:
        """``session``, counted as written into by this put (in ``writing``) so that closing it waits for
        the write; the client's next session where a close in another thread is ending this one."""
        if not session.begin_write():
            session = self._connect()  # the closing thread took it from the client: this opens the next
            if not session.begin_write():
                raise MmfeatError(ErrorCode.BAD_STATE, "the Client was closed twice while this put ran: put "
                                  "after close() has returned, or on a Client that no other thread closes")
        writing.append(session)
        return session

    def _reserve(self, session: Session, pool: PoolInfo, put: PutInFlight,
                 writing: Optional[list[Session]] = None,
                 keyed: Optional[dict[str, Any]] = None) -> tuple[Session, LeaseReply]:
        """The reserve reply and the session it was made in (a new one if the daemon restarted), counted
        in ``writing`` where the caller writes the feature before this returns (put; not reserve, whose
        caller fills the tensors later and close() gives back). ``keyed``: its ``key`` and ``retain_ttl``."""
        fields: dict[str, Any] = {"session": session.token, "nbytes": put.nbytes, "consumers": put.consumers}
        if keyed:
            fields["key"] = keyed.get("key")
            fields["retain_ttl"] = keyed.get("retain_ttl")
        # The daemon's ordinal of the GPU this tensor is on, or -1: its host pool, which on a GPU node is
        # not its first pool.
        fields["device"] = pool.device
        try:
            return session, LeaseReply.from_wire(self._channel.call("reserve", **fields))
        except MmfeatError as exc:
            if exc.code is not ErrorCode.SESSION_CUT and (exc.code is not ErrorCode.NOT_FOUND or session.alive()):
                raise
        # The daemon restarted between our hello and this reserve, or cut the session (SPEC.md, section 9):
        # one fresh session, one retry.
        session = self._reconnect(session)
        if writing is not None:
            session = self._writing_in(session, writing)
        fields["session"] = session.token
        return session, LeaseReply.from_wire(self._channel.call("reserve", **fields))

    def _publish_late(self, session: Session, desc: Descriptor, by_stream: bool = False) -> Descriptor:
        """Publish and wait for the daemon's word: a lease that ended meanwhile is a typed refusal."""
        try:
            session.publish(desc.lease_ref(), by_stream, wait=True)
        except MmfeatError as exc:
            if exc.code not in (ErrorCode.NOT_FOUND, ErrorCode.STALE):
                raise
            raise MmfeatError(ErrorCode.STALE, f"the feature's reserved lease ended before its publish "
                              f"({exc.message}): the daemon's reserve_ttl is shorter than this put's copy; raise "
                              "reserve_ttl and put again") from None
        return desc

    def _release_quietly(self, session: Session, desc: Descriptor) -> None:
        try:
            session.fd.call("release", lease=desc.lease_ref())
        except MmfeatError:
            pass  # gone already, or its session's end frees it

    def fall_back(self, put: PutInFlight, exc: MmfeatError) -> Descriptor:
        """The inline fallback (or, with fallback="error", the raise) that a failure of the pool path calls
        for; an error no fallback answers is raised."""
        if isinstance(exc, FdLimitError):  # the daemon may be fine: no probing, only a pause
            self._fd_short = (time.monotonic() + _FD_SHORT_S, exc)
            return self._fallback_or_raise(put, FallbackReason.FD_LIMIT, exc)
        if isinstance(exc, DaemonUnavailableError):
            self._fallbacks.mark_down()
            return self._fallback_or_raise(put, FallbackReason.UNREACHABLE, exc)
        reason = _FALLBACK_ERRORS.get(exc.code)
        if reason is None:
            raise exc
        return self._fallback_or_raise(put, reason, exc)

    def _fallback_or_raise(self, put: PutInFlight, reason: FallbackReason, exc: Exception) -> Descriptor:
        if self.fallback == "error":
            raise exc
        if put.nbytes > self.inline_max:
            # Gigabytes in a message would stall every process it passes through, and a server that
            # sends one after a single warning learns of it from its memory use.
            raise MmfeatError(
                ErrorCode.TOO_LARGE,
                f"a {put.nbytes} B feature cannot go inline, over inline_max ({self.inline_max} B), and the pool did "
                f"not take it ({reason.value}: {exc}). Fix that, raise inline_max (Client(inline_max=...) or "
                "$MMFEAT_INLINE_MAX), or send smaller features",
            ) from exc
        return self._inline(put, reason, str(exc))

    def _inline(self, put: PutInFlight, reason: FallbackReason, detail: str) -> Descriptor:
        self._fallbacks.record(reason, detail, self.inline_threshold)
        return put.inline()


def _ready_by_stream(session: Session, pool: torch.Tensor, put: PutInFlight, slot: int,
                     gen: int) -> Optional[tuple[Any, int, int]]:
    """What ``_write`` needs to publish behind the GPU's write instead of waiting for it: the table, slot
    and generation, where the daemon asks for READY words and the pool is a GPU's; None otherwise, and
    for a source that is itself pool memory (a relay, ``put(get(desc))``): put returns before its copy
    has read the source, torch's allocator cannot keep memory it does not own from its next user, and
    the caller's ack of the source feature would free it under the copy, so that put waits for its copy."""
    if (pool.is_cuda and session.gpu_publish == "ready_word" and session.table.writable
            and not any(pool_memory(t) for t in put.tensors)):
        return session.table, slot, gen
    return None


def _write(pool: torch.Tensor, offset: int, put: PutInFlight, wait_s: float,
           ready: Optional[tuple[Any, int, int]] = None) -> Optional[tuple[int, int]]:
    """Write the feature into the pool. Where its READY word is queued behind the write on the pool
    device's stream (``ready``: the table, slot and generation), nothing was waited for and the publish
    says so: the (device, stream) it is queued on is returned. None when the write is complete here
    (a wait of ``wait_s`` seconds at most: TIMED_OUT)."""
    tensors = put.tensors
    if pool.is_cuda and any(t.is_cuda and t.device != pool.device for t in tensors):
        # torch runs a cross-device copy on the source device, and only the pool's device (and its
        # owner) was granted access to the pool's VA: bring such a tensor to the pool's device first.
        tensors = [t.to(pool.device) if t.is_cuda and t.device != pool.device else t for t in tensors]
    if pool.is_cuda:
        crossing = {pool.device} if any(not t.is_cuda for t in tensors) else set()
    else:
        crossing = {t.device for t in tensors if t.is_cuda}
    for dev in crossing:
        # A copy between host and GPU memory through pageable pages is synchronous, and the driver first
        # waits for the work queued on the stream, spinning a core through it (the context's default
        # schedule): the wait for that work sleeps here instead, and the driver's finds nothing queued.
        wait_for_current_stream(dev, wait_s)
    packing.write_into_pool(pool, offset, tensors, put.specs)
    if ready is not None:
        # The copies into the pool ran on the pool device's current stream (torch orders a copy from
        # another device there too): the READY word follows them, and consumers' streams wait for it.
        table, slot, gen = ready
        stream = torch.cuda.current_stream(pool.device)
        if ready_word.write_after(table, stream, slot, gen):
            for t in (*put.tensors, *tensors):
                if t.is_cuda:
                    # put returns before the copy has read it: the caching allocator must not hand the
                    # source's memory to anyone before the copy queued on this stream has run.
                    t.record_stream(stream)
            return int(stream.device_index), int(stream.cuda_stream)
    if pool.is_cuda or put.device is not None:
        # Without a READY word behind it the copy must be complete before the descriptor exists. The copy
        # ran on the current stream of the destination or of a source device: finish them all.
        for dev in {t.device for t in put.tensors if t.is_cuda} | ({pool.device} if pool.is_cuda else set()):
            wait_for_current_stream(dev, wait_s)
    return None
