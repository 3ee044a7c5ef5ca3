"""Leases ended wholesale, the ledger's part: by their deadlines, by the end of their session, and at
shutdown. A base of Ledger (daemon/leases/ledger.py), which owns the state these methods change; kept
apart so each file reads as one subject.

A session's end finds its leases through ``_own`` (the ledger keeps it with each lease's life), so
ending one session costs what that session holds, not what every session holds.
"""

from __future__ import annotations

from typing import Any

from .lease import EndReason, Lease, LeaseState


class Endings:
    # The ledger's state these methods use (Ledger sets them; named here, not imported: it imports this).
    keys: Any
    books: Any
    counters: Any
    arenas: Any
    unwritten: Any
    gpu_pools: frozenset[int]
    _leases: dict[int, Lease]
    _own: dict[bytes, dict[int, Lease]]
    _table: Any
    _deadlines: Any

    def expire(self, now: float) -> int:
        """Free every lease whose deadline has passed; the number freed."""
        self.unwritten.settle(now)
        n = 0
        for lease in self._deadlines.due(now):
            if lease.retain_ttl is not None and lease.state is LeaseState.PUBLISHED:
                if lease.holds:
                    continue  # the last of its holds to end frees it (_hold_ended)
                self.counters.retained_expired += 1
                self.keys.count(lease.key, "expired")
                self._free(lease, EndReason.RETAIN_EXPIRED, now)
            elif lease.hold_of is not None:
                self.counters.holds_expired += 1
                self._free(lease, EndReason.EXPIRED_PUBLISHED, now)
            else:
                reason = (EndReason.EXPIRED_RESERVED if lease.state is LeaseState.RESERVED
                          else EndReason.EXPIRED_PUBLISHED)
                self.counters.expired += 1
                self._free(lease, reason, now)
            n += 1
        return n

    def cut_session(self, session: bytes, now: float) -> tuple[int, int]:
        """End every live lease of the session, published ones too, and take its arenas back: it wrote
        words the daemon refused past its limit, so its features are not trusted to be features. The
        number of leases and arenas."""
        leases = list(self._own.get(session, {}).values())
        for lease in leases:
            if self._leases.get(lease.lease_id) is lease:  # a hold's end may have freed what it held
                self._free(lease, EndReason.CUT, now)
        self.books.pop_reserved(session)
        return len(leases), self.arenas.give_back_session(session)

    def reclaim_session(self, session: bytes, now: float) -> int:
        """Free the RESERVED leases of a session whose process is gone, and end its published GPU
        features whose READY word is behind (its GPU never wrote them: a client that closes waits for
        its writes first; their ranges go back after a grace); the others stay for consumers."""
        ids = self.books.pop_reserved(session)
        for lease_id in ids:
            lease = self._leases.get(lease_id)
            if lease is not None:
                self.counters.reclaimed_on_disconnect += 1
                self._free(lease, EndReason.RECLAIMED, now)
        table = self._table
        if table is not None and self.gpu_pools:
            unwritten = [lease for lease in self._own.get(session, {}).values()
                         if lease.pool_id in self.gpu_pools and lease.hold_of is None
                         and lease.state is LeaseState.PUBLISHED and not table.is_ready(lease.lease_id, lease.gen)]
            for lease in unwritten:
                if self._leases.get(lease.lease_id) is lease:
                    self.counters.reclaimed_on_disconnect += 1
                    self._free(lease, EndReason.RECLAIMED, now)  # its range after a grace (unwritten.py)
            self.unwritten.producer_gone(session, now)
        return len(ids)

    def cut_all(self, now: float) -> int:
        """Free everything still live (shutdown); the number cut."""
        leases = list(self._leases.values())
        for lease in leases:
            if self._leases.get(lease.lease_id) is lease:  # a hold's end may have freed what it held
                self.counters.cut_on_shutdown += 1
                self._free(lease, EndReason.SHUTDOWN, now)
        self.unwritten.settle(now, everything=True)
        return len(leases)
