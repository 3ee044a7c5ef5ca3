"""Failures of requests nobody waits for: quiet publishes, acks and releases whose error reply is read
later (by whatever call reads the channel next), and background acks.

Such a failure cannot be raised at the call that caused it, and the call that reads it had nothing to
do with it; a warning for each one would bury a real error under thousands of identical lines (a
consumer that outlives ack_ttl fails every late ack the same way). So each is counted by kind (the op
and the error code), the first of a kind is logged with its message, and close() logs the counts.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from typing import Hashable, Optional

from ..fork_locks import renew_in_child

log = logging.getLogger("mmfeat.client")


class AsyncFailures:
    """Counts of failed pipelined requests, by kind ("ack NOT_FOUND"). Safe to share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._reported: Counter[str] = Counter()
        self.lost_reads = 0
        self._lost: OrderedDict[Hashable, None] = OrderedDict()  # features counted, the latest 4096
        renew_in_child(self)  # a forked child's close() reports through its inherited channel's counts

    @property
    def counts(self) -> Counter[str]:
        with self._lock:
            return Counter(self._counts)

    def lost(self, what: str, key: Optional[Hashable] = None, count: int = 1) -> None:
        """A read of a feature that ended before its producer's GPU wrote it (``what`` names it): counted
        once per feature (``key``), and each said at WARNING, since a consumer that goes on computes from
        bytes that were never the feature's."""
        with self._lock:
            if key is not None:
                if key in self._lost:
                    return
                self._lost[key] = None
                if len(self._lost) > 4096:
                    self._lost.popitem(last=False)
            self.lost_reads += count
        log.warning("a lost read (%s): the feature ended before its producer's GPU wrote it, so what was read of it "
                    "is not its bytes; drop that result and have it sent again (Client.lost_reads counts these)", what)

    def record(self, op: str, code: str, message: str, exc_info: bool = False) -> None:
        kind = f"{op} {code}"
        with self._lock:
            self._counts[kind] += 1
            first = self._counts[kind] == 1
        if code == "LOST":  # a kind of its own, and each one said (lost() does), not only the first
            self.lost(f"{op}: {message}")
        elif first:
            log.warning("a pipelined %s failed: %s: %s (logged once per kind; Client.async_failures counts "
                        "them all)", op, code, message, exc_info=exc_info)

    def report(self) -> None:
        """One line with the kinds counted past their first (logged) one since the last report."""
        with self._lock:
            more = {k: n for k, n in self._counts.items() if n > max(1, self._reported[k])}
            self._reported.update({k: n - self._reported[k] for k, n in more.items()})
        if more:
            log.warning("pipelined requests that failed, by kind: %s",
                        ", ".join(f"{k} x{n}" for k, n in sorted(more.items())))
