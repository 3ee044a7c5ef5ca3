"""Leases ended wholesale, the ledger's part: by their deadlines, by the end of their session, and at
shutdown. A base of Ledger (daemon/leases/ledger.py), which owns the state these methods change; kept
apart so each file reads as one subject.

A session's end finds its leases through ``_own`` (the ledger keeps it with each lease's life), so
ending one session costs what that session holds, not what every session holds.

A client's reservation whose reserve_ttl passes is not freed: its producer may still be writing into
its range (a slow preprocess, a TTL a reload lowered), and a range handed to the next reserve would
take those writes into another producer's feature. It stays RESERVED and ``overdue``, its range and
slot counted against its session's quota (which bounds what a producer whose reservations keep
running late can hold), until its producer publishes it (refused STALE, and freed), releases it, or
ends. The daemon's own leases (a pulled copy) end at their deadline as before.
"""

from __future__ import annotations

from typing import Any

from mmfeat.protos.errors import ErrorCode, MmfeatError

from .lease import EndReason, Lease, LeaseState


class Endings:
    # The ledger's state these methods use (Ledger sets them; named here, not imported: it imports this).
    keys: Any
    books: Any
    counters: Any
    arenas: Any
    unwritten: Any
    gpu_pools: frozenset[int]
    overdue: int
    _leases: dict[int, Lease]
    _own: dict[bytes, dict[int, Lease]]
    _table: Any
    _deadlines: Any

    def expire(self, now: float) -> int:
        """Free every lease whose deadline has passed, but for a client's reservation, which is kept
        overdue; the number freed."""
        self.unwritten.settle(now)
        n = 0
        for lease in self._deadlines.due(now):
            if lease.retain_ttl is not None and lease.state is LeaseState.PUBLISHED:
                if lease.holds:
                    continue  # the last of its holds to end frees it (_hold_ended)
                if lease.doomed is None:
                    self.counters.retained_expired += 1
                    self.keys.count(lease.key, "expired")
                # Doomed: it waited for its pins, and this is ack_ttl after they were seen.
                self._free(lease, lease.doomed or EndReason.RETAIN_EXPIRED, now)
            elif lease.hold_of is not None:
                self.counters.holds_expired += 1
                self._free(lease, EndReason.EXPIRED_PUBLISHED, now)
            elif lease.state is LeaseState.RESERVED and lease.keeps_range:
                self._overdue(lease)
                continue
            else:
                reason = (EndReason.EXPIRED_RESERVED if lease.state is LeaseState.RESERVED
                          else EndReason.EXPIRED_PUBLISHED)
                self.counters.expired += 1
                self._free(lease, reason, now)
            n += 1
        return n

    def refuse_late(self, lease: Lease, now: float, stream_ready: bool = False) -> MmfeatError:
        """The error for a publish of a RESERVED lease at or past its deadline, which is freed here:
        nothing is published, and its range (kept from other features, if overdue) goes back, once the
        producer's GPU stream has written it where ``stream_ready`` says one does (unwritten.py)."""
        if not lease.overdue:
            self._overdue(lease)  # its deadline passed before the timer that marks it ran
        self.counters.late_publishes += 1
        self._free(lease, EndReason.EXPIRED_RESERVED, now, by_stream=stream_ready)
        late, life = now - lease.deadline, lease.deadline - lease.reserved_at
        return MmfeatError(ErrorCode.STALE, f"lease {lease.lease_id} was published {late:.3g} s past its deadline, "
                           f"{life:.3g} s after its reserve (the reserve_ttl it was granted with): nothing was "
                           "published, and its range, kept from other features until now, is released. Reserve "
                           "again, and fill and publish within reserve_ttl (or raise it)")

    def _overdue(self, lease: Lease) -> None:
        """A client's reservation passed its reserve_ttl unpublished: counted, its range kept."""
        lease.overdue = True
        self.overdue += 1
        self.counters.expired += 1

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
        """Free the RESERVED leases of a session whose process is gone, its arena features still awaiting
        their bind, and its published GPU features whose READY word is behind (its GPU never wrote them:
        a client that closes waits for its writes first; their ranges go back after a grace); the others
        stay for consumers."""
        ids = self.books.pop_reserved(session)
        for lease_id in ids:
            lease = self._leases.get(lease_id)
            if lease is not None:
                self.counters.reclaimed_on_disconnect += 1
                self._free(lease, EndReason.RECLAIMED, now)
        # Retained features its arenas still show awaiting their bind: every bind it sent came before the
        # channel's end, so these were never bound, and the puts that stored them never returned.
        for lease in [lease for lease in self._own.get(session, {}).values() if lease.awaiting_bind]:
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
