"""GPU features that ended before their producer's GPU wrote them.

A producer that publishes behind its stream (the lease table's READY word, SPEC.md section 5) may see
its feature end before the copy has landed: its consumers acked without reading, or ``ack_ttl``
passed. Handing the feature's range or single slot to the next reserve then would let the late copy
overwrite another feature, and its late READY store move the slot's word back under the next
generation. So such a feature is ended (its STATE says FREE, readers are refused) but kept here: its
range and slot go back once its READY word shows the write landed, or, once its producer's session has
ended, after a grace for that process's GPU work to be torn down; only then does the daemon store READY
itself, which lets go any stream still waiting on the word. Neither waits longer than ``ready_ttl``
(nor ``ack_ttl``, where that is shorter): a
live producer whose GPU never writes (a faulted context, a stream stuck behind another wait), or a peer
of the group rewriting a READY word (SPEC.md, section 9), must not keep a range out of the pool, and its
consumers' streams waiting, for the life of its producer's session.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from .lease import Lease
from .lease_table import LeaseTable

# How long a dead producer's unwritten GPU features keep their range: its GPU context is torn down as
# its process exits, and the socket whose close the daemon sees may go first.
DEAD_GRACE_S = 2.0


@dataclass
class _Kept:
    lease: Lease
    give_back: Callable[[], None]  # the range and the slot, back to whoever hands them out
    until: float  # ready_ttl (or ack_ttl, the shorter) from its end, or DEAD_GRACE_S from its producer's


class Unwritten:
    def __init__(self, table: Optional[LeaseTable]) -> None:
        self._table = table
        self._kept: list[_Kept] = []
        self.ready_ttl: Optional[float] = None  # the daemon's setting; None: ack_ttl bounds the keep

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, lease: Lease, give_back: Callable[[], None], producer_gone: bool, now: float,
             ack_ttl: float) -> None:
        keep = ack_ttl if self.ready_ttl is None else min(ack_ttl, self.ready_ttl)
        self._kept.append(_Kept(lease, give_back, now + (DEAD_GRACE_S if producer_gone else keep)))

    def producer_gone(self, session: bytes, now: float) -> None:
        for kept in self._kept:
            if kept.lease.session == session:
                kept.until = min(kept.until, now + DEAD_GRACE_S)

    def settle(self, now: float, everything: bool = False) -> None:
        """Give back what was written meanwhile, what outlived its grace, or (shutdown) everything."""
        if not self._kept:
            return
        table, left = self._table, []
        assert table is not None  # nothing is kept without one
        for kept in self._kept:
            lease = kept.lease
            written = table.is_ready(lease.lease_id, lease.gen)
            if written or everything or now >= kept.until:
                if not written:
                    table.ready[lease.lease_id] = lease.gen  # no stream waits on it for good
                kept.give_back()
            else:
                left.append(kept)
        self._kept = left

    def next_deadline(self) -> float:
        return min((k.until for k in self._kept), default=math.inf)
