"""The expiry heap: when each live lease's TTL runs out, for the loop to wake at and the ledger to expire.

A free or a republish (which moves a lease's deadline) leaves the lease's old entry in the heap: each
entry is checked against the lease it names when it reaches the top, and the heap is rebuilt from the
current entries once the stale ones outnumber live leases, so its memory follows live leases, not
throughput x ack_ttl.
"""

from __future__ import annotations

import heapq
import math
from typing import Iterator

from .lease import Lease

# The heap is rebuilt once it holds this many entries more than twice the live leases.
_SLACK = 64


class Deadlines:
    def __init__(self, leases: dict[int, Lease]) -> None:
        self._leases = leases  # the ledger's live leases by slot: read, never changed here
        self._heap: list[tuple[float, int, int]] = []  # (deadline, lease_id, gen)

    def __len__(self) -> int:
        """Entries, stale ones included (stats shows it: it must follow live leases)."""
        return len(self._heap)

    def push(self, lease: Lease) -> None:
        heapq.heappush(self._heap, (lease.deadline, lease.lease_id, lease.gen))
        self.compact()

    def compact(self) -> None:
        if len(self._heap) > 2 * len(self._leases) + _SLACK:
            self._heap = [e for e in self._heap if self._current(e)]
            heapq.heapify(self._heap)

    def due(self, now: float) -> Iterator[Lease]:
        """Each live lease whose deadline is at or before ``now``, earliest first; the caller may free
        each before taking the next."""
        # self._heap read afresh each time: a free may compact it into a new list meanwhile.
        while self._heap and self._heap[0][0] <= now:
            entry = heapq.heappop(self._heap)
            if self._current(entry):
                yield self._leases[entry[1]]

    def earliest(self) -> float:
        """The earliest deadline of a live lease (math.inf: none). Stale entries are dropped from the
        top first: under a stream of reserved features acked well before their TTL, they would wake
        the loop once each."""
        heap = self._heap
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def _current(self, entry: tuple[float, int, int]) -> bool:
        """Whether an entry still belongs to a live lease's current deadline."""
        lease = self._leases.get(entry[1])
        return lease is not None and lease.gen == entry[2] and lease.deadline == entry[0]
