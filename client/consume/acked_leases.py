"""The leases this client acked lately, so that a second ack of one that has ended fails at its call.

An ack that does not wait is a store into the lease table or a quiet message: were a repeat of it sent,
the daemon's refusal would surface on whatever call next read the channel, naming no descriptor. The
client knows better: it acked that lease itself, and the table says the lease has ended. The table
alone cannot say who ended it; this memory can.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from mmfeat.protos.descriptor import Descriptor
from mmfeat.protos.errors import ErrorCode, MmfeatError

from ..fork_locks import renew_in_child
from ..link.session import Session
from ..link.lease_table import STATE_FREE

# A repeat further back than this many acks goes on the wire and is counted as a pipelined failure.
MAX_REMEMBERED = 4096

Key = tuple[int, int, int, int]


class AckedLeases:
    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        # Ordered for its O(1) popitem(last=False): deleting a plain dict's first key again and again leaves
        # dummies at its front that every next(iter()) walks, about 1 µs an ack once the limit is reached.
        self._acks: OrderedDict[Key, int] = OrderedDict()
        renew_in_child(self)  # every ack takes the lock; a forked child acks through the Client it inherited

    def remember(self, desc: Descriptor) -> None:
        """``desc`` (this daemon's, this epoch's) was acked by this client."""
        key = (desc.epoch, desc.pool, desc.lease, desc.gen)
        acks = self._acks
        with self._lock:
            acks[key] = acks.get(key, 0) + 1
            if len(acks) > self._limit:
                acks.popitem(last=False)  # the oldest

    def refuse_repeat(self, session: Session, desc: Descriptor) -> None:
        """Raise NOT_FOUND (STALE once its slot was reused) if this client acked ``desc`` before and the
        lease table says it has ended: the daemon would refuse the ack the same way, but later."""
        with self._lock:
            times = self._acks.get((desc.epoch, desc.pool, desc.lease, desc.gen), 0)
        table = session.table
        if not times or table.state(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes) != STATE_FREE:
            return
        # The codes the daemon would answer: STALE once the slot holds a newer feature, else NOT_FOUND.
        newer = 0 <= desc.lease < table.slots and table.state_word(desc.lease) >> 2 > desc.gen
        raise MmfeatError(
            ErrorCode.STALE if newer else ErrorCode.NOT_FOUND,
            f"lease {desc.lease} (generation {desc.gen}) has ended and this client already acked it {times} time(s); "
            "nothing was sent. Ack a feature once per consumer (count= acks for a group)",
        )
