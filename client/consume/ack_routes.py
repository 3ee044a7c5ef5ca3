"""Ack routing: where a consumer's acknowledgement goes.

By default an ack is a compare-and-swap on the feature's ack word in the lease table: no message, no
round trip; the daemon applies it on its next sweep. ``wait=True`` sends it on the fd channel instead
and returns the daemon's answer. ``after=`` (a CUDA stream or event) records a blocking event behind
that work and hands the ack to a thread that sleeps on the event and adds the ack when it wakes.
Where the table cannot take it (the daemon offers no arenas, no libatomic, or the feature already
ended and the daemon should say so), it goes as a message. Another node's
feature is acked through this node's daemon, which relays the ack to the owner (batched).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from mmfeat.protos.descriptor import Descriptor
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.messages import MAX_CONSUMERS, AckReply

from ..gpu import gpu_order, stream_wait
from .acked_leases import AckedLeases
from ..link.channel import ControlChannel
from .pinned import PendingCopies, pending_key
from ..link.session import Session

log = logging.getLogger("mmfeat.client")

# Acks that timed out, remembered so that retrying one reuses its ack id (the daemon applies it once).
_MAX_UNCONFIRMED_ACKS = 1024


class Acks:
    def __init__(self, connect: Callable[[], Session], channel: ControlChannel, timeout: float,
                 pending: Optional[PendingCopies] = None) -> None:
        self._connect = connect
        self._pending = pending if pending is not None else PendingCopies()
        self._channel = channel
        self._timeout = timeout
        self._acker: Optional[Any] = None
        self._acked = AckedLeases()
        # Ordered for O(1) eviction of the oldest: a plain dict that loses its first key again and again
        # keeps dummies at its front, which every look at its oldest walks.
        self._unconfirmed: OrderedDict[tuple[int, int, int], bytes] = OrderedDict()
        self._closed = False

    def ack(self, desc: Descriptor, count: int, after: Any, wait: bool) -> Optional[dict[str, Any]]:
        check_ack(count, after, wait)
        if desc.kind == "inline":
            return {"remaining": 0, "freed": True, "over_acked": 0} if wait and after is None else None
        staged = self._pending.take_for(desc)  # get(device=) of a host-pool feature: its DMA may still read the pool
        # One fence for the caller's work and the staged copy's: either may still read the pool's bytes.
        try:
            fence = gpu_order.after(after, staged) if after is not None else staged
        except TypeError:
            if staged is not None:  # nothing was acked: a corrected ack must still wait for the copy
                self._pending.add(pending_key(desc), staged)
            raise
        if wait and fence is not None:
            # The caller asked to wait: for the GPU work first (as the acker's lanes do, for a bound), then
            # for the daemon's answer.
            s = self._connect()
            stream_wait.wait_for(fence, s.ack_ttl + s.ready_ttl, f"the GPU work lease {desc.lease}'s ack waits for")
            fence = None
        session = self._connect()
        local = desc.node == session.node and desc.epoch == session.epoch
        if (fence is None and not wait and local
                and session.table.add_acks(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes, count)):
            self._acked.remember(desc)
            return None  # the common ack: one compare-and-swap in the table, nothing built for a message
        if local and not wait:
            self._acked.refuse_repeat(session, desc)
            if fence is None and session.table.lost(desc.lease, desc.gen):
                # Nothing to send: the daemon would refuse it LOST. The read it ends was lost, and is said so.
                self._channel.failures.lost(f"ack of lease {desc.lease} generation {desc.gen}", _key(desc))
                return None
        fields: dict[str, Any] = {"lease": desc.lease_ref()}
        if desc.node != session.node:
            fields["node"] = desc.node  # relayed to the owner's daemon by ours
        reply = None
        if fence is not None:
            self._background().submit(fields, count, os.urandom(8), fence)
        elif not wait:
            self._send_now(session, fields, count)
        else:
            reply = self._waiting_ack(desc, fields, count)
        if local:
            self._acked.remember(desc)
        return reply

    def ack_in_finalizer(self, session: Optional[Session], desc: Descriptor, fence: Any = None) -> bool:
        """One ack from a finaliser, which may run wherever a garbage collection or a tensor's release
        happens, this client's own locked sections included: the table's compare-and-swap (lock-free)
        where it takes the ack, else a message from the background thread, never a lock taken here.
        ``fence``: GPU work that may still read the feature (gpu_order.Fence); then the ack waits for it
        on the acker's thread. True when the ack was a store into the table (nothing left to flush)."""
        if desc.is_inline:
            return True
        if fence is not None:
            self._background().submit({"lease": desc.lease_ref(), "node": desc.node}, 1, os.urandom(8), fence)
            return False
        if session is None or session.pid != os.getpid():
            # No session of this process: the background thread opens one and routes the ack. Not here: a
            # collection inside _connect (this very thread, opening a session under the connect lock) runs
            # finalisers, and connecting from one would wait for that lock for ever.
            self._background().submit({"lease": desc.lease_ref(), "node": desc.node}, 1, os.urandom(8), None)
            return False
        fields: dict[str, Any] = {"lease": desc.lease_ref()}
        if desc.node != session.node:
            fields["node"] = desc.node
        elif desc.epoch == session.epoch and session.table.add_acks(desc.lease, desc.gen, desc.pool, desc.offset,
                                                                    desc.nbytes, 1):
            return True
        self._background().submit(fields, 1, os.urandom(8), None)
        return False

    def run_after(self, fence: Any, action: Callable[[], None], kind: str, what: str) -> None:
        """``action`` on the acker's threads once the GPU work ``fence`` marks is done; at once after
        close (the session that held the space is gone, and no acker should start for it)."""
        if self._closed:
            action()
            return
        self._background().run_after(fence, action, kind, what)

    def _send_now(self, session: Session, fields: dict[str, Any], count: int) -> None:
        """The ack without waiting: in the table if it takes it, else a quiet message."""
        if _table_ack(session, fields, count):
            return
        # Not in the table: another node's feature, one that ended (the daemon logs and counts an
        # over-ack), or no arenas.
        if not session.fd.try_send("ack", count=count, ack_id=os.urandom(8), **fields):
            # A full fd channel (the daemon is behind): the caller must not wait.
            self._background().submit(fields, count, os.urandom(8), None)

    def _waiting_ack(self, desc: Descriptor, fields: dict[str, Any], count: int) -> dict[str, Any]:
        # A retry of an ack that timed out reuses its id, so the daemon applies it once even if the first
        # one did land; a deliberate second ack of the same descriptor gets a new id.
        key = (desc.epoch, desc.lease, desc.gen)
        ack_id = self._unconfirmed.pop(key, None) or os.urandom(8)
        try:
            if "node" in fields:  # answered from the owner's node: on the control socket, which waits for it
                body = self._channel.call("ack", count=count, ack_id=ack_id, **fields)
            else:  # on the fd channel: ordered after this process's own publishes, which travel there too
                body = self._connect().fd.call("ack", count=count, ack_id=ack_id, **fields)
            reply = AckReply.from_wire(body)
        except DaemonUnavailableError:
            self._unconfirmed[key] = ack_id
            while len(self._unconfirmed) > _MAX_UNCONFIRMED_ACKS:
                self._unconfirmed.popitem(last=False)
            raise
        except MmfeatError as exc:
            if exc.code is ErrorCode.LOST:
                self._channel.failures.lost(f"ack of lease {desc.lease} generation {desc.gen}", _key(desc))
            raise
        if reply.over_acked:
            log.warning("lease %d was acked %d time(s) more than its consumer count", desc.lease, reply.over_acked)
        return {"remaining": reply.remaining, "freed": reply.freed, "over_acked": reply.over_acked}

    def flush(self, timeout: float, session: Optional[Session]) -> bool:
        """Wait until the daemon has applied every ack sent so far (background ones included)."""
        if self._acker is not None and self._acker.pid == os.getpid():
            return self._acker.flush(timeout)
        return session.fd.sync(timeout) if session is not None and session.alive() else True

    def _background(self) -> Any:
        if self._acker is None or self._acker.pid != os.getpid():
            from .ack_thread import Acker

            # The thread holds these acks (and through them the Client) weakly: a Client dropped without
            # close() must still end, its session at the daemon too; collecting them stops the thread.
            owner = weakref.ref(self)

            def send(fields: dict[str, Any], count: int, ack_id: bytes) -> None:
                acks = owner()
                if acks is None:
                    return  # dropped without close(): the session is gone, and the lease ends by ack_ttl
                session = acks._connect()
                if fields.get("node") == session.node:  # a finaliser's ack, routed before a session was known
                    fields = {k: v for k, v in fields.items() if k != "node"}
                if _table_ack(session, fields, count):
                    return
                lease = fields["lease"]
                if lease["epoch"] == session.epoch and session.table.lost(lease["lease"], lease["gen"]):
                    # Its GPU work done, the feature turns out never written: that read was lost.
                    acks._channel.failures.lost(f"ack of lease {lease['lease']} generation {lease['gen']}",
                                                (session.node, lease["epoch"], lease["lease"], lease["gen"]))
                    return
                session.fd.send("ack", count=count, ack_id=ack_id, **fields)

            def sync(timeout: float) -> bool:
                acks = owner()
                return acks is None or acks._connect().fd.sync(timeout)

            def bound() -> float:
                # By ack_ttl the daemon has ended the feature, and by ready_ttl more let go any READY word a
                # stream of ours waits on: work not done by then is stuck on something else.
                acks = owner()
                session = acks._connect() if acks is not None else None
                return session.ack_ttl + session.ready_ttl if session is not None else 0.0

            self._acker = Acker(send, sync, self._channel.failures, bound)
            weakref.finalize(self, _stop_in_owner, self._acker, os.getpid())
        return self._acker

    def close(self) -> None:
        # A forked child's copy of its parent's acker has no thread: flushing it would wait out the whole
        # timeout for acks nobody sends, on a condition a parent thread may have held at the fork.
        if self._acker is not None and self._acker.pid == os.getpid():
            self._acker.close(self._timeout)
        self._acker = None
        self._closed = True


def check_ack(count: object, after: object, wait: object) -> None:
    """Refuse an ack's arguments before anything is attempted: a float count reached the table's
    compare-and-swap only to raise there, and a caller (a Parcel) could not tell that from the
    daemon's verdict. ValueError or TypeError: nothing was acked, and a corrected ack still counts."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_CONSUMERS:
        raise ValueError(f"count must be an int between 1 and {MAX_CONSUMERS} (how many consumers this ack is "
                         f"for), not {count!r}")
    if after is not None and not isinstance(after, (torch.cuda.Stream, torch.cuda.Event)):
        raise TypeError(f"after must be a torch.cuda.Stream, a torch.cuda.Event or None, not {type(after).__name__}")
    if type(wait) is not bool:
        raise TypeError(f"wait must be True or False, not {wait!r}")


def _table_ack(session: Session, fields: dict[str, Any], count: int) -> bool:
    """The ack as a store into this daemon's lease table, if the lease is this daemon's and live there.
    A descriptor from before a restart names slots and generations that start again in the new table
    (the same slot, generation and range as a new feature, often): only its epoch tells them apart."""
    lease = fields["lease"]
    if lease["epoch"] != session.epoch or "node" in fields:
        return False  # the message path: the daemon refuses it as STALE, or relays it
    return session.table.add_acks(lease["lease"], lease["gen"], lease["pool"], lease["offset"], lease["nbytes"], count)


def _key(desc: Descriptor) -> tuple[str, int, int, int]:
    return (desc.node, desc.epoch, desc.lease, desc.gen)


def _stop_in_owner(acker: Any, pid: int) -> None:
    # A forked child has no acker thread of this one's (acker() makes a new one there), and the queue's
    # lock may be one a parent thread held at the fork.
    if os.getpid() == pid:
        acker.stop()
