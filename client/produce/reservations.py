"""Zero-copy production: ``reserve`` hands out a tensor over pool memory, the producer fills it in place
(an encoder's ``out=``, a processor writing into it), and ``publish`` dispatches it with no copy.

Space comes from where ``put`` would place the feature: the session's arena (no message), else a
reserved lease (one round trip). Where ``put`` would not use the pool (below the inline threshold,
pool full, daemon down, no pool on the requested GPU), ``reserve`` returns an ordinary tensor and
``publish`` hands it to ``put``, so the caller's code is the same either way.

Every reserved tensor is a view of one DLPack tensor made for its reservation alone, whose deleter runs
when torch frees the last view of it. That is how a reservation dropped without ``publish`` or
``discard`` is noticed: its arena space comes back at once, its reserved lease is released.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence, Union

import torch

from mmfeat.protos.descriptor import Descriptor, TensorSpec
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.messages import MAX_NBYTES, PoolInfo
from mmfeat.protos.tensor_spec import check_tensor_count, packed_strides

from ..gpu import dlpack, gpu_order, ready_word
from .. import tensors as tz
from . import packing
from ..link.arenas import Placement
from ..fork_locks import renew_in_child
from ..neutral import outside_inference
from .in_time import lease_life, publish_in_time
from .keyed import KeyedPuts, check_kept_descriptor
from .producer import _FALLBACK_ERRORS, Producer, check_consumers
from .put_in_flight import PutInFlight
from ..link.session import Session
from ..gpu.stream_wait import DEFAULT_WAIT_S, wait_for

ShapeLike = Union[int, Sequence[int], torch.Size]
TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
# (fence, give_back, kind, what): run give_back once the fence is done.
Later = Callable[[Any, Callable[[], None], str, str], None]

_ATTR = "_mmfeat_reservation"
OPEN, PUBLISHED, DISCARDED, CLOSED, DROPPED = "open", "published", "discarded", "closed", "dropped"
_ENDED_BY = {PUBLISHED: "was published already", DISCARDED: "was discarded",
             CLOSED: "belonged to a Client that was closed", DROPPED: "was dropped"}


class Reservation:
    """One reserved feature: where its bytes are and what publishing it takes.

    ``kind`` is "arena" (a placement in an arena), "lease" (a reserved lease) or "plain" (an ordinary
    tensor that ``publish`` puts)."""

    def __init__(self, owner: "Reservations", kind: str, put: PutInFlight) -> None:
        self.owner = owner
        self.kind = kind
        self.put = put  # its layout, consumers and device (the local CUDA ordinal of the memory)
        self.state = OPEN
        self.session: Optional[Session] = None
        self.desc: Optional[Descriptor] = None
        self.placed: Optional[Placement] = None
        self.reserved_at = time.monotonic()
        # When a reserved lease ends at the daemon (monotonic, as seen here): from its reserve reply,
        # never from hello, whose reserve_ttl a reload may have changed since.
        self.deadline = math.inf
        # A keyed or retained feature's reserve fields (client/produce/keyed.py); None for a plain one.
        self.keyed: Optional[dict[str, Any]] = None
        # Weak: a reservation must not keep its tensors, or a dropped one would never be noticed.
        self.refs: list[weakref.ref] = []


class _Lifetime:
    """Kept alive by torch for as long as any view of a reservation's memory exists."""

    def __init__(self, reservation: Reservation) -> None:
        self.reservation = reservation

    def __del__(self) -> None:
        try:
            self.reservation.owner._dropped(self.reservation)
        except Exception:
            pass  # interpreter exit: the daemon reclaims the session's space when the process is gone


class Reservations:
    """A Client's open reservations. Safe to share between threads."""

    def __init__(self, producer: Producer, later: Optional[Later] = None) -> None:
        self._producer = producer
        # Runs a give-back once GPU work that may still write the space is done (the acker's threads).
        self._later = later
        self._lock = threading.Lock()
        self._open: dict[int, Reservation] = {}
        self._closed = False
        # Dropped reservations whose release found the fd channel's buffer full: sent at the next reserve
        # or close, since the daemon keeps a reservation's range past its TTL while the session lives.
        self._unsent: list[Reservation] = []
        renew_in_child(self)  # a forked child reserves, and closes, through the Client it inherited

    # --- reserve -------------------------------------------------------------------------------

    def reserve(self, layout: Sequence[tuple[ShapeLike, torch.dtype]], consumers: int, device: Any,
                many: bool, keyed: Optional[dict[str, Any]] = None) -> list[torch.Tensor]:
        if self._closed:
            raise MmfeatError(ErrorCode.BAD_STATE, "reserve on a closed Client: open a new Client")
        self._send_unsent()
        check_consumers(consumers)
        target = _device(device)
        checked = [(_shape(shape), _dtype(dtype)) for shape, dtype in layout]
        _check_size(checked)
        metas = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in checked]
        specs, nbytes = packing.layout(metas)
        put = PutInFlight(tuple(specs), nbytes, many, consumers, target.index if target.type == "cuda" else None)
        r = self._in_pool(put, keyed)
        if r is None:
            r = Reservation(self, "plain", put)
            base = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=target)
        else:
            base = self._pool_bytes(r)
        r.keyed = keyed
        return self._hand_out(r, base)

    def _in_pool(self, put: PutInFlight, keyed: Optional[dict[str, Any]] = None) -> Optional[Reservation]:
        """A reservation in the pool, as ``put`` would place the feature; None where put would not (and
        for a keyed one whose key is live: publish then answers that feature)."""
        p, device = self._producer, put.device
        if put.nbytes == 0 or (put.nbytes < p.inline_threshold and not keyed):
            return None
        if p._fallbacks.daemon_down:
            if p.fallback == "error":
                raise DaemonUnavailableError(f"mmfeatd at {p._channel.endpoint} stopped answering; probing it "
                                             "once a second")
            return None
        try:
            session = p._connect()
            pool = p._pool_for(session, device)
            if device is not None and pool.kind != "cuda":
                return None  # no pool on that GPU: a device tensor, which publish puts into a host pool
            if not keyed:  # a keyed or retained feature is the daemon's to find and end: never in an arena
                r = self._in_arena(session, pool, put)
                if r is not None:
                    return r
            if keyed and "key" in keyed:
                check_kept_descriptor(put, session, p._channel.endpoint, pool)
            asked_at = time.monotonic()  # before the request: the deadline here is never later than the daemon's
            session, reply = p._reserve(session, pool, put, keyed=keyed)
            if reply.descriptor is not None:
                return None  # the key's feature is live: no lease was reserved
        except DaemonUnavailableError:
            p._fallbacks.mark_down()
            if p.fallback == "error":
                raise
            return None
        except MmfeatError as exc:
            if exc.code not in _FALLBACK_ERRORS or p.fallback == "error":
                raise
            if exc.code is ErrorCode.TOO_LARGE and put.nbytes > p.inline_max:
                # The pool never takes it and put would refuse it inline: an ordinary tensor of that size
                # could only be filled for a publish that raises (or not be allocated at all).
                raise MmfeatError(ErrorCode.TOO_LARGE, f"a {put.nbytes} B feature is larger than the pool and over "
                                  f"inline_max ({p.inline_max} B): {exc.message}. Raise inline_max or pool_mb, or "
                                  "reserve smaller features") from None
            return None
        lease = reply.lease
        r = Reservation(self, "lease", put)
        r.session = session
        r.reserved_at = asked_at
        r.deadline = asked_at + lease_life(reply.expires_in, session)
        r.desc = put.descriptor(session, p._channel.endpoint, lease.pool, lease.lease, lease.gen, lease.token,
                                lease.offset)
        return r

    def _in_arena(self, session: Session, pool: PoolInfo, put: PutInFlight) -> Optional[Reservation]:
        spot = put.place_in_arena(session, self._producer._channel.endpoint, pool)
        if spot is None:
            return None
        r = Reservation(self, "arena", put)
        r.session, (r.placed, _, r.desc) = session, spot
        return r

    def _pool_bytes(self, r: Reservation) -> torch.Tensor:
        """A uint8 tensor over the reservation's bytes in the pool, its own DLPack tensor. A pool that
        cannot be mapped gives the space back and makes the reservation plain."""
        assert r.session is not None and r.desc is not None
        try:
            pool = self._producer._pool_tensor(r.session, r.desc.pool, r.put.device)
        except (RuntimeError, OSError):  # CudaError too: no IMEX channel, no peer access
            self._give_back(r)
            r.kind, r.session, r.desc, r.placed = "plain", None, None, None
            target = torch.device("cuda", r.put.device) if r.put.device is not None else torch.device("cpu")
            return torch.empty(max(r.put.nbytes, 1), dtype=torch.uint8, device=target)
        if r.desc.offset + r.put.nbytes > pool.numel():
            self._give_back(r)
            raise MmfeatError(ErrorCode.INTERNAL, f"the daemon placed {r.put.nbytes} B at {r.desc.offset} of a "
                              f"{pool.numel()}-byte pool")
        return pool[r.desc.offset: r.desc.offset + r.put.nbytes]

    def _hand_out(self, r: Reservation, memory: torch.Tensor) -> list[torch.Tensor]:
        """The caller's tensors over ``memory``, one DLPack tensor whose last view's end ends ``r``."""
        kind, dev = (dlpack.KDL_CUDA, memory.device.index) if memory.is_cuda else (dlpack.KDL_CPU, 0)
        try:
            base = dlpack.uint8_tensor(memory.data_ptr(), memory.numel(), kind, dev, (memory, _Lifetime(r)))
        except BaseException:
            self._give_back(r)
            raise
        with outside_inference():  # the caller may fill it, and publish it, in any mode: client/neutral.py
            out = [_view(base, spec) for spec in r.put.specs]
        for t in out:
            setattr(t, _ATTR, r)
        r.refs = [weakref.ref(t) for t in out]
        with self._lock:
            self._open[id(r)] = r
        return out

    # --- publish and discard -------------------------------------------------------------------

    def publish(self, tensors: TensorOrList, after: Any = None) -> Descriptor:
        r, given = self._take(tensors, "publish")
        p = self._producer
        if r.put.device is not None:
            try:  # its wait for the fill would fail inside a graph capture, and invalidate it
                for s in (torch.cuda.current_stream(r.put.device), after):
                    if gpu_order.is_stream(s):
                        gpu_order.refuse_capture(s, "publish")
            except MmfeatError:
                self._reopen(r)  # the caller may publish it once the capture is over
                raise
        if r.kind == "plain":
            if after is not None:
                wait_for(gpu_order.after(after), DEFAULT_WAIT_S,  # put finishes the current stream only
                         "the work publish(after=) names")
            try:
                if r.keyed:
                    return KeyedPuts(p).put(given, r.put.many, r.put.consumers, r.keyed)
                return p.put(given, r.put.consumers, r.put.many)
            except BaseException:
                self._reopen(r)  # nothing was sent: the caller may publish again or discard
                raise
        session, desc = r.session, r.desc
        assert session is not None and desc is not None
        if not session.alive() or session is not p._connect():
            # The daemon restarted or went away since the reservation: the bytes are still mapped here,
            # so put carries them as it can (a new pool, or inline).
            self._give_back(r)
            if r.keyed:
                return KeyedPuts(p).put(given, r.put.many, r.put.consumers, r.keyed)
            return p.put(given, r.put.consumers, r.put.many)
        try:
            by_stream = _ready_for_consumers(r, session, after)
        except BaseException:
            self._give_back(r)  # an unpublished placement would hold its arena's ring
            raise
        if r.kind == "arena":
            assert r.placed is not None and session.arenas is not None
            session.arenas.publish(r.placed, r.put.nbytes, r.put.consumers, desc.token, ready=not by_stream)
            return desc
        key = bool(r.keyed) and "key" in r.keyed
        return publish_in_time(session, desc, r.reserved_at, r.deadline, lambda why: _expired(r, why), by_stream, key)

    def discard(self, tensors: TensorOrList) -> None:
        r, _ = self._take(tensors, "discard", DISCARDED)
        self._give_back(r)

    def close(self) -> None:
        """Give back every open reservation (before the session closes: a release still reaches it)."""
        self._closed = True
        with self._lock:
            pending = list(self._open.values())
            self._open.clear()
            for r in pending:
                r.state = CLOSED
        for r in pending:
            self._give_back(r)
        self._send_unsent()

    def _take(self, tensors: TensorOrList, op: str, state: str = PUBLISHED) -> tuple[Reservation, list[torch.Tensor]]:
        """The open reservation ``tensors`` are exactly the tensors of, now ended as ``state``."""
        many = not isinstance(tensors, torch.Tensor)
        given = list(tensors) if many else [tensors]
        r = getattr(given[0], _ATTR, None) if given and isinstance(given[0], torch.Tensor) else None
        if r is None or r.owner is not self:
            whose = "another Client's reserve" if r is not None else "Client.reserve or reserve_many"
            raise MmfeatError(ErrorCode.BAD_REQUEST, f"{op}: not a tensor from {whose} (a view, copy or slice of "
                              f"one is not either): {op} exactly what reserve returned")
        if r.put.many != many or len(given) != len(r.refs) or any(ref() is not t for ref, t in zip(r.refs, given)):
            what = ("the list reserve_many returned, all of it, in order" if r.put.many
                    else "the tensor reserve returned")
            raise MmfeatError(ErrorCode.BAD_REQUEST, f"{op}: pass {what}")
        with self._lock:
            if r.state != OPEN:
                raise MmfeatError(ErrorCode.BAD_STATE, f"{op}: this reservation {_ENDED_BY[r.state]}; reserve "
                                  "again for another feature")
            r.state = state
            self._open.pop(id(r), None)
        return r, given

    def _reopen(self, r: Reservation) -> None:
        with self._lock:
            if self._closed:
                r.state = CLOSED
            else:
                r.state = OPEN
                self._open[id(r)] = r

    # --- giving space back ---------------------------------------------------------------------

    def _dropped(self, r: Reservation) -> None:
        """torch freed the last view of ``r``'s memory. Runs wherever torch frees it, a garbage
        collection inside any of our calls included, so it takes no lock and waits for nothing."""
        if r.state != OPEN:
            return
        r.state = DROPPED
        self._open.pop(id(r), None)
        if self._behind_gpu(r, lambda: self._dropped_now(r)):
            return
        self._dropped_now(r)

    def _dropped_now(self, r: Reservation) -> None:
        if r.kind == "arena" and r.placed is not None:
            r.placed.abandoned = True  # the ring takes the space back on its next placement
        elif r.kind == "lease":
            self._release(r, wait=False)

    def _give_back(self, r: Reservation) -> None:
        if r.session is not None and r.session.pid != os.getpid():
            # A forked child's copy of its parent's reservation: the space is the parent's, to publish or
            # give back, and the arena lock may be held for good by a parent thread that was placing.
            return
        if not self._behind_gpu(r, lambda: self._give_back_now(r)):
            self._give_back_now(r)

    def _give_back_now(self, r: Reservation) -> None:
        if r.kind == "arena" and r.placed is not None and r.session is not None and r.session.arenas is not None:
            r.session.arenas.abandon(r.placed)
        elif r.kind == "lease":
            self._release(r, wait=True)

    def _behind_gpu(self, r: Reservation, give_back: Callable[[], None]) -> bool:
        """For GPU memory: hand ``give_back`` to the acker, to run once the work queued so far on the
        device's current stream is done (a kernel still writing the reservation would write the next
        feature placed there). True if handed over; never waits."""
        if r.put.device is None or self._later is None or r.kind not in ("arena", "lease"):
            return False
        fence = gpu_order.behind_current([r.put.device])
        if fence is None:
            return False
        self._later(fence, give_back, "release", f"reservation of {r.put.nbytes} bytes")
        return True

    def _send_unsent(self) -> None:
        while self._unsent:
            try:
                r = self._unsent.pop()
            except IndexError:  # another thread took the last one
                return
            self._release(r, wait=True)

    def _release(self, r: Reservation, wait: bool) -> None:
        session, desc = r.session, r.desc
        if session is None or desc is None or session.pid != os.getpid():
            return
        try:
            if wait:
                session.fd.send("release", lease=desc.lease_ref())
            elif not session.fd.try_send("release", lease=desc.lease_ref()):
                self._unsent.append(r)  # a list's append takes no lock a collection could be inside
        except MmfeatError:
            pass  # the session is gone: the daemon freed its reserved leases with it
        except OSError:
            pass  # closed under us


def _expired(r: Reservation, why: str = "") -> MmfeatError:
    life = r.deadline - r.reserved_at
    said = f" (the daemon: {why})" if why else ""
    return MmfeatError(ErrorCode.STALE, f"the reservation's lease ended unpublished, {life:.3g} s after it was "
                       f"reserved (the daemon's reserve_ttl when it was granted){said}: nothing was published, and "
                       "its range, kept from other features until now, is released. Reserve again and fill and "
                       "publish within reserve_ttl, or raise reserve_ttl")


def _ready_for_consumers(r: Reservation, session: Session, after: Any) -> bool:
    """The producer's writes must be complete before consumers read the feature. On a GPU that is the
    work queued on the current stream of the memory's device and on ``after`` (the stream or event the
    fill ran on). Where the daemon asks for READY words, a stream of ours waits for that work on the
    GPU and writes the slot's READY word behind it (True: nothing was waited for); otherwise the host
    waits for it here (False)."""
    if r.put.device is None:
        if after is not None:
            wait_for(gpu_order.after(after), session.ready_ttl, "the work publish(after=) names")
        return False
    fence = gpu_order.after(after, gpu_order.current_streams([r.put.device]))
    if (fence is not None and not r.keyed and session.gpu_publish == "ready_word" and session.table.writable
            and ready_word.supported(r.put.device)):
        assert r.desc is not None
        slot, gen = r.desc.lease, r.desc.gen  # an arena placement's slot and generation too
        side = gpu_order.joined(fence, r.put.device)
        if side is not None:
            if ready_word.write_after(session.table, side, slot, gen):
                session.ready_streams.add((r.put.device, side.cuda_stream))
                return True
            fence = gpu_order.after(side)  # the work it joined, now waited for on the host
    wait_for(fence, session.ready_ttl, "the reservation's fill")
    return False


def _view(base: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    # Every tensor, an empty one too, is a view of ``base``: the reservation lives as long as any does.
    flat = base[spec.offset: spec.offset + spec.extent].view(tz.torch_dtype(spec.dtype))
    return flat.as_strided(spec.shape, spec.strides)


def _shape(shape: ShapeLike) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
    try:
        out = tuple(dims)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {type(shape).__name__}") from None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in out):
        raise ValueError(f"shape must hold non-negative ints, got {out!r}")
    return out


def _check_size(layout: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Refuse a layout no feature can have before torch sees it: a size or stride past 2^63 is an overflow
    error of torch's own, not a typed one. Its bytes are bounded by protos' MAX_NBYTES, its dimensions
    and strides by what a descriptor carries (packed_strides)."""
    check_tensor_count(len(layout))
    for shape, _ in layout:
        packed_strides(shape)
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)
    if total > MAX_NBYTES:
        raise ValueError(f"the shapes {[shape for shape, _ in layout]} take {total} bytes, over the {MAX_NBYTES} a "
                         "feature may have; reserve smaller features")


def _dtype(dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    tz.dtype_name(dtype)  # raises TypeError for a dtype mmfeat cannot carry
    return dtype


def _device(device: Any) -> torch.device:
    try:
        target = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be None, 'cpu', 'cuda:N', an int or a torch.device, got {device!r}") from None
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"reserve places features in host or CUDA memory, not {target.type}")
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this process sees no CUDA device")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
    return target
