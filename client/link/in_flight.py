"""The requests of one control connection whose replies may still come, counted so that the client
keeps them within MAX_IN_FLIGHT, within which the daemon drops no reply (SPEC.md, section 2).

The daemon handles one connection's requests in order and answers each before it takes the next, but
for those that wait on another node (deferred). So any reply read settles every request sent before
it that is not deferred: a quiet request's error reply, if it had one, came first, and a call that
timed out was answered first or never will be. A deferred request counts until its own reply, or
until the daemon can no longer be answering it.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from typing import Hashable, Optional


class InFlight:
    """Not thread-safe: the channel's lock guards it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seq = itertools.count()
        # key -> the order it was sent in; oldest first, for settling a prefix in O(settled).
        self._ordered: OrderedDict[Hashable, int] = OrderedDict()
        # key -> (the order it was sent in, when its reply can no longer come).
        self._deferred: dict[Hashable, tuple[int, float]] = {}
        self._keys: dict[Hashable, int] = {}  # every key held, to its order

    def sent(self, key: Optional[Hashable] = None, answered_by: Optional[float] = None) -> None:
        """A request went out: ``key`` is what its reply will name (None: a quiet request, whose reply
        names no single request); ``answered_by`` (monotonic) for a deferred one."""
        seq = next(self._seq)
        if key is None:
            key = ("quiet", seq)
        self._keys[key] = seq
        if answered_by is None:
            self._ordered[key] = seq
        else:
            self._deferred[key] = (seq, answered_by)

    def answered(self, key: Hashable) -> None:
        """A reply naming ``key`` was read: it, and every ordered request sent before it, are settled."""
        seq = self._keys.pop(key, None)
        if seq is None:
            return  # not ours (a hint's reply, one evicted by clear()), or settled already
        self._deferred.pop(key, None)
        while self._ordered:
            first, first_seq = next(iter(self._ordered.items()))
            if first_seq > seq:
                break
            self._ordered.popitem(last=False)
            self._keys.pop(first, None)

    def count(self, now: Optional[float] = None) -> int:
        now = time.monotonic() if now is None else now
        for key in [k for k, (_, by) in self._deferred.items() if by < now]:
            del self._deferred[key]
            self._keys.pop(key, None)
        return len(self._ordered) + len(self._deferred)

    def room(self, n: int = 1) -> bool:
        """Whether ``n`` more requests keep the connection within the limit."""
        return self.count() + n <= self.limit

    def clear(self) -> None:
        """The connection is gone: nothing sent on it can be answered any more."""
        self._ordered.clear()
        self._deferred.clear()
        self._keys.clear()


def deferred_until(op: str, fields: dict, deadline: float, timeout: float) -> Optional[float]:
    """When a request that waits on another node can no longer be answered (None for any other): the
    daemon takes it by its deadline and answers within its ``wait_s`` (a relayed ack, within a timeout)."""
    if op == "remote_get" or (op == "ack" and "node" in fields):
        wait_s = fields.get("wait_s")
        return deadline + (float(wait_s) if isinstance(wait_s, (int, float)) else timeout) + timeout
    return None

