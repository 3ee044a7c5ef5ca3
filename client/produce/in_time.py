"""Publishing a reserved lease by its deadline: the one rule every publish path of a reserved lease
follows (a reservation's publish, keyed or retained or counted, and a keyed or retained put).

The deadline is the lease's own, from its reserve reply (a reload may have changed hello's reserve_ttl
since), as seen from before the reserve request left, so it is never later than the daemon's. Past it
nothing is written into the lease table and nothing is published: the lease is released and the
caller gets STALE. In the first half of its life a publish is pipelined (the daemon will have it well
before the deadline); after that, or with a key (whose feature the daemon may answer instead), it
waits for the daemon's word, which refuses a publish that arrived late.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from mmfeat.protos.descriptor import Descriptor
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.messages import LeaseReply

from ..link.session import Session

# Makes the caller's STALE from what the daemon said, if it said anything ("" when nothing was sent).
Late = Callable[[str], MmfeatError]


def lease_life(expires_in: Optional[float], session: Session) -> float:
    """Seconds a reserved lease lives from its reserve: its reply's own, else (a daemon that does not
    send it) hello's reserve_ttl."""
    return float(expires_in) if expires_in is not None else session.reserve_ttl


def publish_in_time(session: Session, desc: Descriptor, reserved_at: float, deadline: float, late: Late,
                    by_stream: bool = False, key: bool = False) -> Descriptor:
    """Publish the reserved lease ``desc`` names, whose bytes are written, by ``deadline`` (monotonic);
    the descriptor consumers read (with ``key``, another producer's where its publish came first).
    ``by_stream``: a GPU stream writes its READY word behind the fill. Raises ``late(...)`` when the
    deadline has passed, here or at the daemon."""
    now = time.monotonic()
    if now >= deadline:
        _release(session, desc, by_stream)
        raise late("")
    if not key and now - reserved_at < (deadline - reserved_at) / 2:
        if not by_stream:
            session.table.mark_ready(desc.lease, desc.gen)
        session.publish(desc.lease_ref(), by_stream)  # as put does: in the daemon's socket buffer on return
        return desc
    # Near its deadline the lease may end before the publish arrives: wait for the daemon's word rather
    # than hand out a descriptor of something else (the daemon stores READY, but behind a stream's write).
    sent = desc.to_bytes() if key else None
    try:
        if key:
            reply = LeaseReply.from_wire(session.fd.call("publish", lease=desc.lease_ref(), descriptor=sent))
        else:
            reply = LeaseReply.from_wire(session.publish(desc.lease_ref(), by_stream, wait=True))
    except MmfeatError as exc:
        if isinstance(exc, DaemonUnavailableError):
            raise
        if exc.code in (ErrorCode.NOT_FOUND, ErrorCode.STALE):
            raise late(exc.message) from None
        # Refused for another reason, so never published: no deadline frees a reservation any more.
        _release(session, desc, by_stream)
        raise MmfeatError(exc.code, f"the feature was not published: {exc.message}") from None
    if reply.descriptor is not None and reply.descriptor != sent:
        return Descriptor.from_bytes(reply.descriptor)
    return desc


def _release(session: Session, desc: Descriptor, by_stream: bool) -> None:
    """Give back a lease that will not be published, once nothing this process queued writes into it."""
    if by_stream and not session.settle_ready_writes(session.ready_ttl):
        # The fill and its READY word must not land after the range went back: a stream that does not
        # move in ready_ttl keeps it this session's, until the session ends.
        return
    try:  # waited for: an ended lease's refusal is the expected answer, not an async failure
        session.fd.call("release", lease=desc.lease_ref())
    except MmfeatError:
        pass
