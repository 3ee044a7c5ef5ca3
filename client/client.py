"""``mmfeat.client.Client``: put tensors into the node's pool, get them out zero-copy, acknowledge.

One Client per process is the intended use (it is safe to share between threads); pool mappings are
cached per process anyway, so short-lived Clients cost a hello and an fd handshake, not a remap.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from mmfeat.protos.descriptor import Descriptor
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.paths import control_endpoint, default_runtime_dir

from .arguments import DescLike, as_descriptor, check_device, check_stream, check_wait
from .consume.ack_routes import Acks
from .link.channel import ControlChannel
from .consume.consumer import Consumer
from .produce.fallbacks import FallbackTracker
from .produce.keyed import KeyedPuts, KeyLookups, check_lifetime
from .link.lease_table import LeaseTableView
from .consume.pinned import PendingCopies
from .produce.producer import Producer
from .produce.reservations import Reservations, ShapeLike, TensorOrList
from .gpu import ready_word
from .link.daemon_lock import gone_daemon
from .link.key_feed import check_prefix
from .link.session import Session, open_session

log = logging.getLogger("mmfeat.client")

DEFAULT_TIMEOUT_S = float(os.environ.get("MMFEAT_TIMEOUT", "5"))
# Below this, carrying the bytes in the message itself costs less than the pool; from it up, the pool
# (where the crossover lies: docs/performance.md).
DEFAULT_INLINE_THRESHOLD = int(os.environ.get("MMFEAT_INLINE_THRESHOLD", str(64 * 1024)))
# The largest feature put sends inline when the pool cannot take it; a larger one raises TOO_LARGE.
DEFAULT_INLINE_MAX = int(os.environ.get("MMFEAT_INLINE_MAX", str(256 << 20)))



# Every Client of this process, whose connect lock a forked child takes fresh (as client/link/channel.py does
# its channels' locks): a thread of the parent opening a session at the fork holds it there for good.
_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _unlock_in_child() -> None:
    for client in list(_clients):
        client._connect_lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


class Client:
    def __init__(
        self,
        runtime_dir: Union[str, Path, None] = None,
        endpoint: Optional[str] = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        fallback: str = "inline",
        name: str = "",
        readonly: bool = False,
        inline_max: int = DEFAULT_INLINE_MAX,
        map_pools: bool = True,
        key_feed: Optional[str] = None,
    ) -> None:
        """``readonly=True`` is for processes that only consume: the pool is mapped read-only, so an
        in-place write into a tensor from ``get`` kills this process (SIGSEGV) instead of changing what
        other consumers read, and ``put`` raises FORBIDDEN. ``map_pools=False`` is for processes that
        only look features up and hold them (a scheduler): no pool is mapped, not even received, and
        put, reserve and get raise FORBIDDEN; has, lookup, hold, ack, evict and stats work. ``key_feed``
        (a key prefix, such as ``Namespace(...).id + "/"``): follow the daemon's key feed for those keys
        from the session's start, for ``feed_find``."""
        if fallback not in ("inline", "error"):
            raise ValueError("fallback must be 'inline' or 'error'")
        if not isinstance(readonly, bool):
            raise TypeError(f"readonly must be True or False, not {readonly!r}")
        if not isinstance(map_pools, bool):
            raise TypeError(f"map_pools must be True or False, not {map_pools!r}")
        self.readonly = readonly
        self.map_pools = map_pools
        self.key_feed = check_prefix(key_feed)
        for setting, value in (("inline_threshold", inline_threshold), ("inline_max", inline_max)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{setting} must be an int of bytes >= 0, not {value!r}")
        self.runtime_dir = Path(runtime_dir) if runtime_dir is not None else default_runtime_dir()
        self.endpoint = endpoint or control_endpoint(self.runtime_dir)
        self.timeout = timeout
        self.name = name or f"pid{os.getpid()}"
        self._fallbacks = FallbackTracker(self.endpoint, timeout)
        self._channel = ControlChannel(self.endpoint, timeout)
        self._session: Optional[Session] = None
        # The lease table of the session close() ended, with its pid, node and epoch: tensors from get()
        # outlive close(), and their finalisers' acks go there (this reference keeps the table mapped).
        self._closed_table: Optional[tuple[int, str, int, LeaseTableView]] = None
        self._connect_lock = threading.Lock()
        _clients.add(self)
        self._producer = Producer(self._connect, self._reconnect, self._channel, self._fallbacks, inline_threshold,
                                  inline_max, fallback, self._session_now)
        self._reservations = Reservations(self._producer, lambda *a: self._acks.run_after(*a))
        pending = PendingCopies(timeout=timeout)  # staged copies from host pools: get() adds them, ack() waits
        # A staged copy's own hold is let go by an ack that waits for the copy (client/consume/consumer.py).
        self._consumer = Consumer(self._connect, self._channel, pending,
                                  lambda hold: self._acks.ack(hold, 1, None, False), readonly)
        self._acks = Acks(self._connect, self._channel, timeout, pending)
        self._keyed = KeyedPuts(self._producer)
        self._keys = KeyLookups(self._channel, self._connect)
        # A process that exits (or drops the client) without close() still reports its fallbacks.
        self._report_at_exit = weakref.finalize(self, self._fallbacks.close, 1.0)

    @property
    def inline_threshold(self) -> int:
        return self._producer.inline_threshold

    @property
    def inline_max(self) -> int:
        return self._producer.inline_max

    @property
    def fallback(self) -> str:
        return self._producer.fallback

    @property
    def fallbacks(self) -> Counter[str]:
        """Features this client sent inline, by reason."""
        return self._fallbacks.counts

    @property
    def lost_reads(self) -> int:
        """Reads of GPU features that ended before their producer's GPU wrote them, as this client
        learnt of them (a get, verify or ack refused LOST, an ack after GPU work that found the feature
        so, a wait let go on a daemon that is gone): each logged at WARNING. A consumer that read such
        a feature computed from bytes that were not its own: drop that result."""
        return self._channel.failures.lost_reads

    @property
    def async_failures(self) -> Counter[str]:
        """Requests nobody waited for that failed (quiet publishes and acks, background acks), by kind:
        "<op> <error code>". The first of each kind is logged; close() logs the counts."""
        return self._channel.failures.counts

    # --- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the sockets. Tensors already returned stay valid: they hold the pool's pages, which are
        unmapped once the last of them is gone and no other client of this process uses the pool.
        Arenas go back to the pool once the features in them are acked; first, close waits for the GPU
        writes of features published behind a stream (their READY words). A put still writing in another
        thread finishes first: close() waits up to 2 s for it, then leaves ending the session to it."""
        self._report_at_exit.detach()
        self._reservations.close()
        self._acks.close()
        self._fallbacks.close(min(self.timeout, 2.0))
        # Under the lock: a put or get in another thread may be replacing the session right now.
        with self._connect_lock:
            s = self._session
            if s is not None:
                self._closed_table = (s.pid, s.node, s.epoch, s.table)  # first: finalisers read both unlocked
                self._session = None
        if s is not None:
            # Not while a put in another thread still writes into the session's space: the daemon would
            # hand it to another producer, whose feature that put then overwrites.
            s.retire(lambda: self._end_session(s), min(self.timeout, 2.0))
        self._channel.failures.report()
        self._channel.close()

    def _end_session(self, s: Session) -> None:
        # Publishes went into the lease table or on the fd channel: the daemon reads both before it
        # handles this close.
        if not s.alive():
            self._let_go(s, None)
        elif s.arenas is not None and s.pid == os.getpid():
            # Its READY writes first, for the client's timeout at most: the arenas then go back with no
            # copy still queued into them, which the daemon would have to keep apart
            # (daemon/leases/unwritten.py), and no feature still being written ends as a dead producer's.
            s.settle_quietly(self.timeout)
            s.arenas.give_back_all(min(self.timeout, 2.0))
        s.close()

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
        if session is not None and session.fd.alive():  # Session.alive, one frame less: every put, get and ack
            return session
        with self._connect_lock:
            old = self._session
            if old is not None:
                if old.alive():
                    return old  # another thread reconnected first
                # Closing our copies is safe after a fork too: the parent keeps its own. Nothing to settle:
                # its daemon closed the channel (it exited, restarted, or cut the session).
                old.close()
                self._session = None
            try:
                self._session = open_session(self._channel, self.runtime_dir, self.name, self.timeout,
                                             self.readonly, self.map_pools, self.key_feed)
            finally:
                if old is not None:
                    self._let_go(old, self._session)
            self._closed_table = None
            return self._session

    def _let_go(self, old: Session, now: Optional[Session]) -> None:
        """Let go this process's GPU waits on ``old``'s lease table where its daemon is gone (``now``, the
        next session, is another daemon's, or none is there): nobody else will store those READY words,
        and a stream waiting on one would wait for good. Each is a lost read (Client.lost_reads)."""
        if old.pid != os.getpid() or (now is not None and now.epoch == old.epoch):
            return
        if now is None and gone_daemon(self.runtime_dir, ask_socket=False) is None:
            return  # perhaps alive and slow: its ready_ttl lets its features go
        n = ready_word.let_go(old.table)
        if n:
            self._channel.failures.lost(f"{n} GPU wait(s) on a gone daemon's features, let go", count=n)

    def _session_now(self) -> Optional[Session]:
        """The open session, or None where _connect would have to open one."""
        session = self._session
        return session if session is not None and session.fd.alive() else None

    def _reconnect(self, stale: Session) -> Session:
        """A fresh session after the daemon forgot ``stale`` (it restarted)."""
        with self._connect_lock:
            if self._session is stale:
                stale.close()  # nothing to settle: the daemon forgot or cut the session
                self._session = None
        return self._connect()

    # --- producer ------------------------------------------------------------------------------

    def put(self, tensor: torch.Tensor, consumers: int = 1, key: Optional[str] = None,
            retain_ttl: Optional[float] = None, wait: bool = True) -> Descriptor:
        """Place one tensor in the pool for ``consumers`` consumers; returns its descriptor.

        ``key`` (``Namespace(...).key(name)``): the feature is found by it (has, lookup, hold, get(key=))
        while it lives, and a put under a key that names a live feature returns that feature's descriptor
        (these bytes are not kept). ``retain_ttl`` (seconds): retained instead of counted, kept after any
        number of reads until that long after its publish with no hold on it, or until the pool needs the
        space (then features nothing holds go, oldest first, before any put goes inline), or evict(key).
        Either costs two round trips (the daemon learns of the feature before anyone can find it).

        ``wait=False`` (with a key or a retain_ttl): no round trip. The feature goes into this client's
        arena and one message it does not wait for binds its key and lifetime; any lookup made after put
        returned finds it. The bytes are always copied: where the key names a live feature already, the
        key keeps naming that one, and the descriptor returned names this put's own feature, readable for
        its own lifetime but found by no key. A refused bind is counted in ``async_failures``. Where no
        arena takes the feature it waits for its reserve alone (its publish and bind follow pipelined);
        where the daemon predates bind, as ``wait=True``. A CUDA tensor's copy may still be
        queued when put returns: memory torch did not allocate (DLPack, CUDA IPC) must not be freed or
        rewritten before the current stream ran it (docs/gpu.md)."""
        if self.readonly or not self.map_pools:
            self._check_writable()
        if key is not None or retain_ttl is not None:
            return self._keyed.put([tensor], False, consumers, check_lifetime(key, retain_ttl, consumers),
                                   check_wait(wait))
        return self._producer.put_one(tensor, consumers)

    def put_many(self, tensors: Sequence[torch.Tensor], consumers: int = 1, key: Optional[str] = None,
                 retain_ttl: Optional[float] = None, wait: bool = True) -> Descriptor:
        """Place several tensors in one lease (one descriptor, one ack per consumer); ``key``,
        ``retain_ttl`` and ``wait`` as for put. The daemon keeps a keyed feature's descriptor for lookups, of at most
        ``mmfeat.protos.messages.MAX_KEPT_DESCRIPTOR_BYTES``: too many tensors under one key raise
        BAD_REQUEST before anything is placed (put them under several keys, or without a key)."""
        if isinstance(tensors, torch.Tensor):
            raise TypeError("put_many takes a list of tensors, not one tensor (whose rows it would put one by one); "
                            "put one tensor with put")
        if not tensors:
            raise ValueError("put_many needs at least one tensor")
        self._check_writable()
        if key is not None or retain_ttl is not None:
            return self._keyed.put(list(tensors), True, consumers, check_lifetime(key, retain_ttl, consumers),
                                   check_wait(wait))
        return self._producer.put(list(tensors), consumers, many=True)

    def _check_writable(self) -> None:
        if not self.map_pools:
            raise MmfeatError(ErrorCode.FORBIDDEN, "this Client maps no pool (map_pools=False): it looks features up "
                                                   "and holds them; put and get in a Client that maps the pools")
        if self.readonly:
            raise MmfeatError(ErrorCode.FORBIDDEN, "this Client maps the pool read-only (readonly=True) and cannot "
                                                   "put; producers use a Client without readonly")

    def reserve(self, shape: ShapeLike, dtype: torch.dtype, consumers: int = 1, device: Any = None,
                key: Optional[str] = None, retain_ttl: Optional[float] = None) -> torch.Tensor:
        """An uninitialised tensor over pool memory (on ``device``'s GPU pool, or a host pool) for the
        producer to fill in place; ``publish(t)`` then dispatches it with no copy. Where put would not
        use the pool (a small feature, a full pool, no daemon) it is an ordinary tensor and publish puts it.
        Publish or discard it within reserve_ttl (later, publish raises STALE; until then its range stays
        this client's, so writes made late land in no other feature); one dropped unpublished gives its
        space back.
        ``key`` and ``retain_ttl`` are given here, as put takes them; ``publish(t)`` then returns the
        key's live feature where another producer's came first (a live key at reserve: ``t`` is an
        ordinary tensor, and publish puts it under the key, which then answers that feature)."""
        self._check_writable()
        keyed = check_lifetime(key, retain_ttl, consumers) if key is not None or retain_ttl is not None else None
        return self._reservations.reserve([(shape, dtype)], consumers, device, many=False, keyed=keyed)[0]

    def reserve_many(self, layout: Sequence[tuple[ShapeLike, torch.dtype]], consumers: int = 1,
                     device: Any = None, key: Optional[str] = None,
                     retain_ttl: Optional[float] = None) -> list[torch.Tensor]:
        """Tensors of the given (shape, dtype) pairs in one feature, as put_many packs them; publish the
        list to dispatch them (one descriptor, one ack per consumer); ``key`` and ``retain_ttl`` as reserve."""
        if not layout:
            raise ValueError("reserve_many needs at least one (shape, dtype)")
        self._check_writable()
        keyed = check_lifetime(key, retain_ttl, consumers) if key is not None or retain_ttl is not None else None
        return self._reservations.reserve(list(layout), consumers, device, many=True, keyed=keyed)

    def publish(self, reserved: TensorOrList, after: Any = None) -> Descriptor:
        """Dispatch what reserve (or reserve_many) returned, once filled: the descriptor put would give.
        From then on the tensor belongs to the consumers: do not write it. On a GPU the writes queued on
        the device's current stream, and on ``after`` (the torch.cuda.Stream or Event the fill ran on,
        when not the current one), are finished first. A tensor not reserved by this client, or one
        published, discarded or closed already, raises BAD_REQUEST or BAD_STATE."""
        return self._reservations.publish(reserved, after)

    def discard(self, reserved: TensorOrList) -> None:
        """Give back what reserve returned without publishing it; the tensor must not be used after."""
        self._reservations.discard(reserved)

    def release(self, desc: DescLike) -> None:
        """Producer only: cancel a feature that was never dispatched to its consumers."""
        desc = as_descriptor(desc)
        if not desc.is_inline:
            self._connect().fd.call("release", lease=desc.lease_ref())

    # --- consumer ------------------------------------------------------------------------------

    def get(
        self, desc: DescLike = None, copy: bool = False, verify: bool = True, device: Any = None,
        key: Optional[str] = None, stream: Any = None,
    ) -> Union[torch.Tensor, list[torch.Tensor]]:
        """The tensor (or list, for put_many) a descriptor names.

        Zero-copy by default: a view into the shared pool, valid until this consumer acks. It is the
        pool itself: an in-place op on it changes what every consumer reads (with ``readonly=True`` it
        kills this process instead), so work in place on ``copy=True`` tensors, which are private.
        ``device`` (a CUDA device) stages a private copy into that device's own memory on its current
        stream: complete when get returns, except for a host-pool feature, copied from pinned pages
        without waiting, whose next ``ack`` waits for that copy. ``verify`` checks that the lease is
        still live, so a descriptor that outlived its lease raises STALE or NOT_FOUND instead of reading
        reused memory. The check reads the daemon's lease table (shared memory): a live lease costs no
        round trip, and only a lease the table calls gone is looked up, for the reason.

        ``key`` instead of ``desc``: ``lookup(key)`` then a get of what it names (NOT_FOUND if nothing
        is live under it). No hold protects such a read: a retained feature may be evicted under
        pressure while a view of it is in use. Read with ``copy=True``, which checks again after
        copying and raises STALE or NOT_FOUND if the feature ended meanwhile, or hold it first. A staged
        copy (``device``, a host-pool feature), which nothing checks after, is protected instead: a
        retained feature is held for the copy (a hold of one, acked once the copy has run; ``stats``
        counts it in ``holds``), and a counted one found by key is copied synchronously and checked
        after. ``verify=False`` drops these checks too.

        A GPU feature may be published before its producer's GPU has written it (SPEC.md, section 5). A
        view of it is then complete only on one stream: the current stream of its device, which waits
        on the GPU for the write, or ``stream`` (a torch.cuda.Stream of that device) where the caller
        reads it elsewhere; another stream must ``wait_stream`` that one first. ``copy=True`` and
        ``device`` wait on the host for the write, for the daemon's ``ready_ttl`` at most (TIMED_OUT).
        A feature that ended before its GPU wrote it raises LOST: what was read of it is not its bytes.
        """
        if type(copy) is not bool or type(verify) is not bool:
            raise TypeError(f"copy and verify must be True or False, not {copy!r} and {verify!r}")
        if device is not None:
            check_device(device)
        if stream is not None:
            check_stream(stream)
        if not self.map_pools:
            self._check_writable()
        if key is not None:
            if desc is not None:
                raise ValueError("get takes a descriptor or a key, not both")
            found = self._keys.lookup(key)
            if found is None:
                raise MmfeatError(ErrorCode.NOT_FOUND, "no live feature under that key (never put, ended, evicted, "
                                  "or from before a daemon restart)")
            return self._consumer.get(found, copy, verify, device, True, stream)
        if desc is None:
            raise ValueError("get needs a descriptor or a key")
        return self._consumer.get(desc if type(desc) is Descriptor else as_descriptor(desc), copy, verify, device,
                                  False, stream)

    def prefetch(self, descs: Union[DescLike, Sequence[DescLike]], wait_s: Optional[float] = None) -> None:
        """Start making other nodes' features readable here without waiting: this node's daemon pulls
        each now, and a later get() of it finds it pulled or under way. A scheduler that received a batch
        calls this for the whole batch, then gets each. Does nothing for this node's features and inline
        ones; a prefetch that fails is dropped (the get then says why). ``wait_s``: how long each pull
        may take (default: the client's timeout)."""
        for d in descs if isinstance(descs, (list, tuple)) else [descs]:
            self._consumer.prefetch(as_descriptor(d), wait_s)

    def hold_remote(self, desc: DescLike, count: int = 1, wait_s: float = 5.0) -> Descriptor:
        """Another node's feature pulled here (one pull per node, shared) and held for ``count`` readers,
        who get() and ack() the descriptor returned as this node's; the copy stays while held. TIMED_OUT
        if the pull has not landed within ``wait_s`` (it goes on: ask again); else get()'s errors."""
        return self._consumer.hold_remote(as_descriptor(desc), count, wait_s)

    def ack(self, desc: DescLike, count: int = 1, after: Any = None, wait: bool = False) -> Optional[dict[str, Any]]:
        """Tell the daemon ``count`` consumers are done with this feature. Views from get() must not be
        read afterwards: the memory may be reused at once.

        By default this is one compare-and-swap in the lease table: no message, no round trip; the
        daemon applies it on its next sweep (at most a second later, sooner while features flow).
        ``wait=True`` sends it to the daemon and returns its answer (remaining, freed, over_acked).
        ``after`` (a torch.cuda.Stream or Event) returns at once; a background thread adds the ack once
        the event completes (the GPU work that read the feature is done). ``flush()`` waits until the
        daemon has applied them all. With both, the call waits for that work, then for the daemon's
        answer. A staged get's copy (``get(device=)`` of a host-pool feature) is waited for in every case.
        """
        return self._acks.ack(desc if type(desc) is Descriptor else as_descriptor(desc), count, after, wait)

    def _ack_in_finalizer(self, desc: Descriptor, fence: Any = None) -> bool:
        """``ack(desc)`` for a finaliser (Acks.ack_in_finalizer says why it differs), after the GPU work
        ``fence`` marks (client/gpu/gpu_order.py) if any; True when it was a store into the lease table,
        False when it went (or was left) elsewhere."""
        session, closed = self._session, self._closed_table
        if session is None and closed is not None and not desc.is_inline:
            if fence is not None and not fence.query():
                return False  # no acker after close, and no wait here: the feature expires by ack_ttl
            # No session is opened here: a round trip inside a garbage collection, and a session nobody
            # would close. What the table cannot take (another node's feature) expires by ack_ttl.
            pid, node, epoch, table = closed
            return (pid == os.getpid() and desc.node == node and desc.epoch == epoch
                    and table.add_acks(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes, 1))
        return self._acks.ack_in_finalizer(session, desc, fence)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the daemon has applied every ack this client made; False on timeout."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout < float("inf")):
            raise ValueError(f"timeout must be None or a finite number of seconds >= 0, not {timeout!r}")
        return self._acks.flush(self.timeout if timeout is None else timeout, self._session)

    # --- keys ----------------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        """Whether a feature is live under ``key`` now (a hint: hold it to keep it)."""
        return self._keys.has_many([key])[0]

    def has_many(self, keys: Sequence[str]) -> list[bool]:
        """``has`` of each key, in one round trip (at most MAX_LOOKUP_KEYS keys: TOO_LARGE past it)."""
        return self._keys.has_many(keys if isinstance(keys, list) else list(keys))

    def lookup(self, key: str) -> Optional[Descriptor]:
        """The descriptor of the feature live under ``key``, or None."""
        return self._keys.lookup(key)

    def hold(self, target: Union[str, DescLike], count: int = 1) -> Optional[Descriptor]:
        """Protect a retained feature (by key, or its descriptor) for ``count`` readers: while the hold
        lives nothing frees the feature, not its retain_ttl, not the pool's need for space, not an evict.
        The descriptor returned is what the readers get() and ack(): each ack releases one of ``count``,
        from any process. The hold also ends after ack_ttl, and with this Client's session (a holder that
        dies gives its holds back). None when nothing is live under the key."""
        return self._keys.hold(target if isinstance(target, str) else as_descriptor(target), count)

    def hold_many(self, keys: Sequence[str], count: int = 1, timeout: Optional[float] = None,
                  feed_wait: float = 0.0) -> list[Optional[tuple[Descriptor, bool]]]:
        """``lookup`` and ``hold`` of each key in one round trip (at most MAX_LOOKUP_KEYS keys): per key,
        None when nothing is live under it, else ``(descriptor, held)``. A retained feature is held for
        ``count`` readers as ``hold`` does (``held`` True: acks of the descriptor end the hold); a counted
        one is answered with its own descriptor (``held`` False: its consumer count protects its
        readers, and each ack takes one of it). All of the holds or none: OVER_QUOTA or POOL_FULL as
        ``hold`` raises them. ``timeout``: seconds to wait for the answer (default: the client's).

        With ``key_feed``, a key the feed names is answered with no round trip where the lease table
        shows its feature live: a retained one *pinned* for ``count`` reads in its own ACKS word (the
        descriptor is the feature's own; each reader's ack releases one, and an unread pin is given back
        by acking it as often; the daemon waits at most ack_ttl for them), a counted one as it is. Only
        the keys left go to the daemon, in one round trip. ``feed_wait``: seconds to wait for the feed
        to bring keys it has not yet, before those are asked for (for keys known to be saved: their bind
        is on its way through the daemon, and the round trip would wait for it too)."""
        return self._keys.hold_keys(keys if isinstance(keys, list) else list(keys), count, timeout,
                                    self.key_feed is not None, feed_wait)

    def feed_find(self, key: str) -> Optional[bytes]:
        """The descriptor bytes the daemon's key feed last gave for ``key`` (Client(key_feed=) a prefix of
        it), with no round trip; None without a feed or an entry. A hint, never a promise: the feed is
        lossy, so None means "ask the daemon" (lookup, hold_many), and an entry may be stale (the feature
        ended, or the daemon restarted), so validate it before use: a get checks the lease table, and a
        hold of it refuses a feature that ended."""
        try:
            feed = self._connect().feed if self.key_feed is not None else None
        except DaemonUnavailableError:
            return None  # the lookup a miss leads to says why
        return feed.find(key) if feed is not None else None

    def evict(self, key: str) -> bool:
        """No key finds the feature any more; a retained one is freed once nothing holds it. False when
        nothing was live under ``key``."""
        return self._keys.evict(key)

    # --- operators -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        reply = self._channel.call("stats")
        return {k: v for k, v in reply.items() if k not in ("v", "id", "ok")}

    def ping(self) -> dict[str, Any]:
        return self._channel.call("ping")


def _silence_frombuffer_warning() -> None:
    # torch warns once per process that a tensor over immutable bytes is writable; views are read-only
    # by contract. Spend that one warning here, at import, because catch_warnings around every get()
    # would swap the process-wide filters under other threads.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


_silence_frombuffer_warning()
