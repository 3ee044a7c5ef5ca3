"""The scheduler half's books of its loads: which requests wait on each step's loads, and how many acks
each held load still owes the item once its ranks have reported.

A load's units are its ranks' acks: each rank that runs the step acks the load's descriptor once,
whether it loaded, found the item cached or failed. What a rank did not ack (it died) the scheduler
gives back, so a hold never outlives its request and a counted item is never left waiting for a
consumer that will not come. Two things of vLLM's say when the rest is known, and neither depends on
whether vLLM finishes a request before or after it applies its step's report:

- **A step's loads are run by its ranks whatever happens to their requests.** vLLM sends a step to the
  workers as soon as it is scheduled; a request finished afterwards (it stopped in the step that
  loaded it, an abort, a failure) does not take the load back. Giving back a unit before the ranks
  reported would count a load twice: ``update_from_output`` finishes the requests that stopped this
  step before it hands the connector this step's report.
- **Every step's report comes back, in the order the steps were sent.** The ranks' reports of one step
  are aggregated onto that step's output, and the engine applies its outputs first in, first out. So a
  load is settled by its own step's report, and a report for a later step means an earlier step that
  has not reported never will (no rank ran it): its units are given back whole.

So a request that finishes first leaves its loads to their report, and a report that comes first leaves
the give-back to the request's end: each load costs the item exactly its ranks' acks in either order.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class _Held:
    blob: bytes  # the descriptor the ranks ack (a hold's, or a counted item's own)
    units: int  # acks owed: the ranks', until their report; after it, what the scheduler gives back
    step: int = 0  # the step whose metadata carries it (0: not sent yet)
    settled: bool = False  # its step's report came back


@dataclasses.dataclass
class Release:
    """Units of a held load that no rank acked: the scheduler acks them now."""

    mm_hash: str
    blob: bytes
    units: int


class LoadBooks:
    def __init__(self, ranks: int) -> None:
        self._ranks = ranks
        self._sent = 0  # the number of the last step sent with loads
        self._scheduling: dict[str, set[str]] = {}  # this step's loads, mm_hash -> request ids
        self._in_flight: dict[int, dict[str, set[str]]] = {}  # step -> mm_hash -> request ids, until reported
        self._held: dict[str, dict[str, _Held]] = {}  # request id -> mm_hash -> its held load
        self._finished: set[str] = set()  # requests that ended with a held load not yet settled

    def add(self, request_id: str, mm_hash: str, blob: Optional[bytes]) -> None:
        """A load of this step for ``request_id``; ``blob`` is the descriptor its ranks will ack, where
        the scheduler holds the units (None for another node's descriptor, whose acks are its owner's).
        A second request that wants an item already loading this step waits on the same load."""
        waiting = self._scheduling.setdefault(mm_hash, set())
        waiting.add(request_id)
        if blob is not None and len(waiting) == 1:
            self._held.setdefault(request_id, {})[mm_hash] = _Held(blob, self._ranks)

    def send(self) -> int:
        """This step's loads go to the ranks: the number their reports will name (0: none went)."""
        if not self._scheduling:
            return 0
        self._sent += 1
        for h, rids in self._scheduling.items():
            for rid in rids:
                held = self._held.get(rid, {}).get(h)
                if held is not None and not held.step:
                    held.step = self._sent
        self._in_flight[self._sent] = self._scheduling
        self._scheduling = {}
        return self._sent

    def report(self, step: int, acked: dict[str, int]) -> tuple[dict[str, set[str]], list[Release]]:
        """Step ``step``'s report: ``acked`` is how many ranks acked each load. Returns the requests
        still running that waited on each load of that step, and what to give back now: the loads of
        requests that already ended, and all of every earlier step that never reported."""
        releases: list[Release] = []
        for lost in sorted(s for s in self._in_flight if s < step):
            releases += self._settle(lost, self._in_flight.pop(lost), {})
        loads = self._in_flight.pop(step, {})
        waiting = {h: rids - self._finished for h, rids in loads.items()}
        releases += self._settle(step, loads, acked)
        return waiting, releases

    def _settle(self, step: int, loads: dict[str, set[str]], acked: dict[str, int]) -> list[Release]:
        releases = []
        for h, rids in loads.items():
            for rid in rids:
                held = self._held.get(rid, {}).get(h)
                if held is None or held.step != step or held.settled:
                    continue
                held.units = max(0, held.units - acked.get(h, 0))
                held.settled = True
                if rid in self._finished:
                    releases += self._give_back(rid, h)
                    if rid not in self._held:
                        self._finished.discard(rid)
        return releases

    def finish(self, request_id: str) -> list[Release]:
        """``request_id`` ended: what to give back now. A load whose report has not come back (it is
        being scheduled, or on the ranks) is given back, less what its ranks acked, when it does."""
        releases = []
        for h in [h for h, x in self._held.get(request_id, {}).items() if x.settled]:
            releases += self._give_back(request_id, h)
        if request_id in self._held:
            self._finished.add(request_id)
        return releases

    def pending(self) -> int:
        """Held loads not given back yet: an idle scheduler's books are empty."""
        return sum(len(x) for x in self._held.values())

    def _give_back(self, rid: str, h: str) -> list[Release]:
        held = self._held[rid].pop(h)
        if not self._held[rid]:
            del self._held[rid]
        return [Release(h, held.blob, held.units)] if held.units else []
