"""``mmfeat.client.Client``: put tensors into the node's pool, get them out zero-copy, acknowledge.

One Client per process is the intended use (it is safe to share between threads); pool mappings are
cached per process anyway, so short-lived Clients cost a hello and an fd handshake, not a remap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from mmfeat.protos.descriptor import Descriptor, DescriptorError, TensorSpec
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.messages import FallbackReason
from mmfeat.protos.paths import control_endpoint, default_runtime_dir

from . import mapping as mapping_cache
from . import tensors as tz
from .channel import ControlChannel
from .fallbacks import FallbackTracker
from .session import Session, open_session

log = logging.getLogger("mmfeat.client")

DEFAULT_TIMEOUT_S = float(os.environ.get("MMFEAT_TIMEOUT", "5"))
# Below this the pool's round trips cost more than carrying the bytes in the message itself. On the
# 2-core reference machine inline and pool cross between 256 KiB and 1 MiB (docs/benchmarks.md); 256 KiB
# keeps the crossover's fast side and keeps messages that carry bytes small.
DEFAULT_INLINE_THRESHOLD = int(os.environ.get("MMFEAT_INLINE_THRESHOLD", str(256 * 1024)))
_FALLBACK_ERRORS = {
    ErrorCode.POOL_FULL: FallbackReason.POOL_FULL,
    ErrorCode.TOO_LARGE: FallbackReason.TOO_LARGE,
    ErrorCode.DRAINING: FallbackReason.DRAINING,
    ErrorCode.OVER_QUOTA: FallbackReason.OVER_QUOTA,
}
# Acks that timed out, remembered so that retrying one reuses its ack id (the daemon applies it once).
_MAX_UNCONFIRMED_ACKS = 1024

DescLike = Union[Descriptor, bytes]


class Client:
    def __init__(
        self,
        runtime_dir: Union[str, Path, None] = None,
        endpoint: Optional[str] = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        fallback: str = "inline",
        name: str = "",
    ) -> None:
        if fallback not in ("inline", "error"):
            raise ValueError("fallback must be 'inline' or 'error'")
        self.runtime_dir = Path(runtime_dir) if runtime_dir is not None else default_runtime_dir()
        self.endpoint = endpoint or control_endpoint(self.runtime_dir)
        self.timeout = timeout
        self.inline_threshold = inline_threshold
        self.fallback = fallback
        self.name = name or f"pid{os.getpid()}"
        self._fallbacks = FallbackTracker(self.endpoint, timeout)
        self._channel = ControlChannel(self.endpoint, timeout)
        self._session: Optional[Session] = None
        self._connect_lock = threading.Lock()
        self._acker: Optional[Any] = None
        self._unconfirmed_acks: dict[tuple[int, int, int], bytes] = {}
        # A process that exits (or drops the client) without close() still reports its fallbacks.
        self._report_at_exit = weakref.finalize(self, self._fallbacks.close, 1.0)

    @property
    def fallbacks(self) -> Counter[str]:
        """Features this client sent inline, by reason."""
        return self._fallbacks.counts

    # --- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the sockets. Pool mappings stay cached for the process; tensors already returned stay valid."""
        self._report_at_exit.detach()
        if self._acker is not None:
            self._acker.close(self.timeout)
            self._acker = None
        self._fallbacks.close(min(self.timeout, 2.0))
        # Publishes went on the fd channel: the daemon reads them before it sees this close.
        if self._session is not None:
            self._session.close()
            self._session = None
        self._channel.close()

    @property
    def session(self) -> Session:
        """The session with the daemon, opened on first use: its token, pools, lease table and fd
        channel. For tools and protocol tests; put, get and ack need none of it."""
        return self._connect()

    def request(self, op: str, timeout: Optional[float] = None, **fields: Any) -> dict[str, Any]:
        """One request on the control socket exactly as SPEC.md section 3 defines it, for tools and
        protocol tests; raises MmfeatError for an error reply."""
        return self._channel.call(op, timeout=timeout, **fields)

    def connect(self) -> None:
        """Open the session and map the host pools now, so the first put or get does not pay for it
        (a server calls this at startup). Raises DaemonUnavailableError if the daemon is not there."""
        self._connect()

    def _connect(self) -> Session:
        session = self._session
        if session is not None and session.alive():
            return session
        with self._connect_lock:
            if self._session is not None:
                if self._session.alive():
                    return self._session  # another thread reconnected first
                # Closing our copies is safe after a fork too: the parent keeps its own.
                self._session.close()
                self._session = None
            self._session = open_session(self._channel, self.runtime_dir, self.name, self.timeout)
            return self._session

    # --- producer ------------------------------------------------------------------------------

    def put(self, tensor: torch.Tensor, consumers: int = 1) -> Descriptor:
        """Place one tensor in the pool for ``consumers`` consumers; returns its descriptor."""
        return self._put([tensor], consumers, many=False)

    def put_many(self, tensors: Sequence[torch.Tensor], consumers: int = 1) -> Descriptor:
        """Place several tensors in one lease (one round trip, one publish, one ack per consumer)."""
        if not tensors:
            raise ValueError("put_many needs at least one tensor")
        return self._put(list(tensors), consumers, many=True)

    def _put(self, tensors: list[torch.Tensor], consumers: int, many: bool) -> Descriptor:
        if not 1 <= consumers <= 4096:
            raise ValueError("consumers must be between 1 and 4096")
        specs, nbytes = tz.layout(tensors)
        if nbytes < self.inline_threshold or nbytes == 0:
            return self._inline(tensors, specs, nbytes, many, FallbackReason.BELOW_THRESHOLD, "")
        device = next((t.device.index for t in tensors if t.is_cuda), None)
        if self._fallbacks.daemon_down:
            # Known down: inline at once instead of waiting out a timeout per put; a background probe
            # notices when it answers again.
            exc = DaemonUnavailableError(f"mmfeatd at {self.endpoint} stopped answering; probing it once a second")
            return self._fallback_or_raise(tensors, specs, nbytes, many, FallbackReason.UNREACHABLE, exc)
        try:
            session, reply = self._reserve(self._connect(), nbytes, consumers, device)
        except DaemonUnavailableError as exc:
            self._fallbacks.mark_down()
            return self._fallback_or_raise(tensors, specs, nbytes, many, FallbackReason.UNREACHABLE, exc)
        except MmfeatError as exc:
            reason = _FALLBACK_ERRORS.get(exc.code)
            if reason is None:
                raise
            return self._fallback_or_raise(tensors, specs, nbytes, many, reason, exc)
        lease = reply["lease"]
        pool = session.pools[lease["pool"]]
        desc = Descriptor(
            kind=pool["kind"],
            tensors=tuple(specs),
            nbytes=nbytes,
            many=many,
            node=session.node,
            endpoint=self.endpoint,
            device=pool["device"],
            pool=lease["pool"],
            epoch=lease["epoch"],
            lease=lease["lease"],
            gen=lease["gen"],
            token=lease["token"],
            offset=lease["offset"],
        )
        try:
            # A GPU pool is mapped (once) on the producer tensor's device.
            try:
                with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                    dst = session.mapping(desc.pool, device).tensor[desc.offset : desc.offset + nbytes]
            except (RuntimeError, OSError) as exc:  # CudaError too: no IMEX channel, no peer access, ...
                self._release_quietly(session, desc)
                return self._fallback_or_raise(tensors, specs, nbytes, many, FallbackReason.MAP_FAILED, exc)
            tz.write_packed(dst, tensors, specs)
            if dst.is_cuda or device is not None:
                # Imported VMM memory cannot be waited on by stream-value ops on current drivers, so the
                # copy must be complete before the descriptor exists (see research/cuda_vmm.md). The copy
                # ran on the current stream of the destination or of a source device: finish them all.
                for dev in {t.device for t in tensors if t.is_cuda} | ({dst.device} if dst.is_cuda else set()):
                    torch.cuda.current_stream(dev).synchronize()
            # On the fd channel: in the daemon's socket buffer when this returns, so it is handled even
            # if this process dies now. Nothing waits for it (a consumer's table check and lookup accept
            # a RESERVED lease, and its ack counts early); a failure is logged when its reply is read.
            session.publish(desc.lease_ref())
        except BaseException:
            self._release_quietly(session, desc)
            raise
        return desc

    def _reserve(
        self, session: Session, nbytes: int, consumers: int, device: Optional[int]
    ) -> tuple[Session, dict[str, Any]]:
        """The reserve reply and the session it was made in (a new one if the daemon restarted)."""
        fields: dict[str, Any] = {"session": session.token, "nbytes": nbytes, "consumers": consumers}
        pool = session.pool_on_local_device(device) if device is not None else None
        if pool is not None:
            fields["device"] = pool["device"]  # the daemon's ordinal of the GPU this tensor is on
        try:
            return session, self._channel.call("reserve", **fields)
        except MmfeatError as exc:
            if exc.code is not ErrorCode.NOT_FOUND or session.alive():
                raise
        # The daemon restarted between our hello and this reserve: one fresh session, one retry.
        session.close()
        self._session = None
        session = self._connect()
        fields["session"] = session.token
        return session, self._channel.call("reserve", **fields)

    def _release_quietly(self, session: Session, desc: Descriptor) -> None:
        try:
            session.call("release", lease=desc.lease_ref())
        except MmfeatError:
            pass  # it expires after reserve_ttl anyway

    def _fallback_or_raise(
        self, tensors: list[torch.Tensor], specs: list[TensorSpec], nbytes: int, many: bool, reason: FallbackReason, exc: Exception
    ) -> Descriptor:
        if self.fallback == "error":
            raise exc
        return self._inline(tensors, specs, nbytes, many, reason, str(exc))

    def _inline(
        self, tensors: list[torch.Tensor], specs: list[TensorSpec], nbytes: int, many: bool, reason: FallbackReason, detail: str
    ) -> Descriptor:
        self._fallbacks.record(reason, detail, self.inline_threshold)
        # One copy into a bytearray that msgpack packs as-is.
        buf = bytearray(nbytes)
        if nbytes:
            tz.write_packed(torch.frombuffer(buf, dtype=torch.uint8), [t.cpu() for t in tensors], specs)
        return Descriptor(kind="inline", tensors=tuple(specs), nbytes=nbytes, many=many, inline=buf)

    # --- consumer ------------------------------------------------------------------------------

    def get(
        self, desc: DescLike, copy: bool = False, verify: bool = True, device: Any = None
    ) -> Union[torch.Tensor, list[torch.Tensor]]:
        """The tensor (or list, for put_many) a descriptor names.

        Zero-copy by default: a view into the shared pool, valid until this consumer acks. ``copy=True``
        returns private tensors. ``device`` (a CUDA device) stages a private copy into that device's own
        memory on its current stream. ``verify`` checks that the lease is still live, so a descriptor that
        outlived its lease raises STALE or NOT_FOUND instead of reading reused memory. The check reads the
        daemon's lease table (shared, read-only): a live lease costs no round trip, and only a lease the
        table calls gone is looked up, for the reason.
        """
        desc = _as_descriptor(desc)
        if desc.is_inline:
            out = [tz.view(_inline_base(desc, copy and device is None), spec) for spec in desc.tensors]
            return _finish(out, desc.many, False, device)
        session = self._connect()
        if desc.node != session.node:
            raise MmfeatError(ErrorCode.FORBIDDEN, f"descriptor is from node {desc.node!r}; this client's daemon is {session.node!r}")
        if desc.epoch != session.epoch:
            raise MmfeatError(
                ErrorCode.STALE, f"descriptor is from daemon epoch {desc.epoch}, the daemon is now epoch {session.epoch}: it restarted; re-send the feature"
            )
        pool = session.pools.get(desc.pool)
        if pool is None or desc.offset + desc.nbytes > pool["size"]:
            raise MmfeatError(ErrorCode.FORBIDDEN, f"lease [{desc.offset}, +{desc.nbytes}) is outside pool {desc.pool}")
        if verify:
            self._verify(session, desc)
        base = session.mapping(desc.pool).tensor[desc.offset : desc.offset + desc.nbytes]
        out = _finish([tz.view(base, spec) for spec in desc.tensors], desc.many, copy, device)
        if verify and (copy or device is not None):
            # The lease may have ended while we copied; then the copy may hold someone else's bytes.
            self._verify(session, desc)
        return out

    def _verify(self, session: Session, desc: Descriptor) -> None:
        """Raise unless the lease table shows ``desc``'s lease live with exactly its pool, offset and size.
        A live lease costs no round trip; otherwise ``lookup`` asks the daemon, whose error says why
        (expired, acked, reused slot, a range that does not match)."""
        state = session.table.state(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes)
        if state > mapping_cache.STATE_FREE:
            return
        self._channel.call("lookup", lease=desc.lease_ref())
        if state == mapping_cache.STATE_MISMATCH:  # the daemon found it fine: the table is the authority on ranges
            raise MmfeatError(ErrorCode.FORBIDDEN, f"lease {desc.lease}'s range in the lease table differs from the descriptor's")

    def ack(self, desc: DescLike, count: int = 1, after: Any = None, wait: bool = True) -> Optional[dict[str, Any]]:
        """Tell the daemon ``count`` consumers are done with this feature. Views from get() must not be
        read afterwards: the memory may be reused at once.

        Plain ``ack`` waits for the daemon's answer and returns it. ``wait=False`` returns None at once:
        the ack is one write on the fd channel, no round trip, handled even if this process dies next.
        ``after`` (a torch.cuda.Stream or Event) also returns at once; a background thread sends the ack
        once the event completes (the GPU work that read the feature is done). ``flush()`` waits for both.
        """
        desc = _as_descriptor(desc)
        if desc.is_inline:
            return {"remaining": 0, "freed": True, "over_acked": 0} if wait and after is None else None
        if after is not None or not wait:
            ack_id = os.urandom(8)
            if after is None and self._connect().try_send("ack", lease=desc.lease_ref(), count=count, ack_id=ack_id):
                return None
            # A GPU event to wait for, or a full fd channel (the daemon is behind): the caller must not wait.
            self._background_acker().submit(desc.lease_ref(), count, ack_id, _completion_event(after))
            return None
        # A retry of an ack that timed out reuses its id, so the daemon applies it once even if the first
        # one did land; a deliberate second ack of the same descriptor gets a new id.
        key = (desc.epoch, desc.lease, desc.gen)
        ack_id = self._unconfirmed_acks.pop(key, None) or os.urandom(8)
        try:
            # On the fd channel: ordered after this process's own publishes, which travel there too.
            reply = self._connect().call("ack", lease=desc.lease_ref(), count=count, ack_id=ack_id)
        except DaemonUnavailableError:
            self._unconfirmed_acks[key] = ack_id
            while len(self._unconfirmed_acks) > _MAX_UNCONFIRMED_ACKS:
                del self._unconfirmed_acks[next(iter(self._unconfirmed_acks))]
            raise
        if reply["over_acked"]:
            log.warning("lease %d was acked %d time(s) more than its consumer count", desc.lease, reply["over_acked"])
        return {k: reply[k] for k in ("remaining", "freed", "over_acked")}

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the daemon has handled every background ack; False on timeout."""
        timeout = self.timeout if timeout is None else timeout
        if self._acker is not None and self._acker.pid == os.getpid():
            return self._acker.flush(timeout)
        session = self._session
        return session.sync(timeout) if session is not None and session.alive() else True

    def _background_acker(self) -> Any:
        if self._acker is None or self._acker.pid != os.getpid():
            from .acker import Acker

            def send(lease: dict[str, Any], count: int, ack_id: bytes) -> None:
                self._connect().send("ack", lease=lease, count=count, ack_id=ack_id)

            self._acker = Acker(send, lambda timeout: self._connect().sync(timeout))
        return self._acker

    def release(self, desc: DescLike) -> None:
        """Producer only: cancel a feature that was never dispatched to its consumers."""
        desc = _as_descriptor(desc)
        if not desc.is_inline:
            self._connect().call("release", lease=desc.lease_ref())

    # --- operators -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        reply = self._channel.call("stats")
        return {k: v for k, v in reply.items() if k not in ("v", "id", "ok")}

    def ping(self) -> dict[str, Any]:
        return self._channel.call("ping")


def _finish(views: list[torch.Tensor], many: bool, copy: bool, device: Any) -> Union[torch.Tensor, list[torch.Tensor]]:
    sources = {t.device for t in views if t.is_cuda}
    if device is not None:
        target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        views = [t.to(target, copy=True) for t in views]
        if target.type == "cuda":
            sources.add(target)
    elif copy:
        views = [t.clone() for t in views]
    else:
        return views if many else views[0]
    # A private copy must be complete before get() returns: the caller may ack at once, and the pool
    # range can then be reused. torch queues a copy on the current stream of the source device (and,
    # across devices, may involve the target's), so finish both.
    for dev in sources:
        torch.cuda.current_stream(dev).synchronize()
    return views if many else views[0]


def _completion_event(after: Any) -> Optional[Any]:
    """An event that completes when the work queued on ``after`` so far is done (None: nothing to wait on)."""
    if after is None:
        return None
    if isinstance(after, torch.cuda.Event):
        return after
    if isinstance(after, torch.cuda.Stream):
        # blocking: the acker thread sleeps in synchronize() instead of spinning a core on it.
        event = torch.cuda.Event(blocking=True)
        event.record(after)
        return event
    raise TypeError(f"after must be a torch.cuda.Stream or torch.cuda.Event, not {type(after).__name__}")


def _inline_base(desc: Descriptor, copy: bool) -> torch.Tensor:
    """A uint8 tensor over an inline descriptor's bytes: shared with them (read-only by contract, like a
    pool view) or, with ``copy``, private and writable."""
    data = desc.inline
    if not desc.nbytes or data is None:
        return torch.empty(0, dtype=torch.uint8)
    if copy or isinstance(data, bytearray):
        return torch.frombuffer(bytearray(data) if copy else data, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)  # read-only by contract, like a pool view


def _silence_frombuffer_warning() -> None:
    # torch warns once per process that a tensor over immutable bytes is writable; views are read-only
    # by contract. Spend that one warning here, at import, because catch_warnings around every get()
    # would swap the process-wide filters under other threads.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


_silence_frombuffer_warning()


def _as_descriptor(desc: DescLike) -> Descriptor:
    if isinstance(desc, Descriptor):
        return desc
    if isinstance(desc, (bytes, bytearray, memoryview)):
        try:
            return Descriptor.from_bytes(bytes(desc))
        except DescriptorError as exc:
            raise MmfeatError(ErrorCode.BAD_REQUEST, str(exc)) from None
    raise TypeError(f"expected a Descriptor or its bytes, got {type(desc).__name__}")
