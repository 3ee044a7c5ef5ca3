"""What each session holds: bytes of the pool, single lease slots, and its RESERVED leases.

The ledger asks here before it gives a session more, so that one session can take neither the pool
(``max_session_mb``) nor the lease table's single slots, whose range every sweep reads
(``max_session_leases``; SPEC.md, section 9).
"""

from __future__ import annotations

from mmfeat.protos.errors import ErrorCode, MmfeatError

from .counters import Counters


class SessionBooks:
    def __init__(self, counters: Counters, quota_bytes: int = 0, max_singles: int = 0) -> None:
        self.counters = counters
        self.quota_bytes = quota_bytes  # bytes a session's live leases and arenas may hold; 0: no limit
        self.max_singles = max_singles  # single slots a session may hold; 0: no limit
        self._bytes: dict[bytes, int] = {}
        self._singles: dict[bytes, int] = {}
        self._reserved: dict[bytes, set[int]] = {}
        self._holds: dict[bytes, set[int]] = {}  # slots of the session's holds, which end with it

    # --- limits ----------------------------------------------------------------------------------

    def check_bytes(self, session: bytes, size: int, what: str) -> None:
        """Raise OVER_QUOTA if ``size`` more bytes would take the session past max_session_mb."""
        if not self.quota_bytes:
            return
        held = self._bytes.get(session, 0)
        if held + size > self.quota_bytes:
            raise MmfeatError(ErrorCode.OVER_QUOTA, f"this session holds {held} B and max_session_mb allows "
                              f"{self.quota_bytes} B; {what}")

    def check_single(self, session: bytes) -> None:
        """Raise OVER_QUOTA if the session holds max_session_leases single slots already."""
        held = self._singles.get(session, 0)
        if self.max_singles and held >= self.max_singles:
            raise MmfeatError(ErrorCode.OVER_QUOTA, f"this session holds {held} leases outside arenas, the "
                              "max_session_leases limit; send inline, or ack and release features sooner")

    def admits_single(self, session: bytes, size: int, less_bytes: int = 0, less_singles: int = 0) -> bool:
        """admit_single would let the session reserve one more single lease of ``size``; nothing counted.
        ``less_bytes`` and ``less_singles``: as if the session held that much less (what an eviction of
        its own features would give back)."""
        held = self._bytes.get(session, 0) - less_bytes
        return ((not self.quota_bytes or held + size <= self.quota_bytes)
                and not (self.max_singles and self._singles.get(session, 0) - less_singles >= self.max_singles))

    def admits_holds(self, session: bytes, n: int) -> bool:
        """``n`` more holds would keep the session within max_session_leases; nothing counted."""
        return not self.max_singles or self._singles.get(session, 0) + n <= self.max_singles

    def short_of_singles(self, session: bytes) -> bool:
        """The session holds max_session_leases single slots: only freeing one of them admits another."""
        return bool(self.max_singles) and self._singles.get(session, 0) >= self.max_singles

    def bytes_of(self, session: bytes) -> int:
        """The bytes the session holds, as max_session_mb counts them."""
        return self._bytes.get(session, 0)

    def slots_of(self, session: bytes) -> set[int]:
        """The single slots the session's reserved leases and holds are in."""
        return self._reserved.get(session, set()) | self._holds.get(session, set())

    def admit_single(self, session: bytes, size: int) -> None:
        """Raise OVER_QUOTA (and count it) unless the session may reserve one more single lease of ``size``."""
        try:
            self.check_bytes(session, size, "send inline, or ack and release features sooner")
            self.check_single(session)
        except MmfeatError:
            self.counters.over_quota += 1
            raise

    # --- bookkeeping -----------------------------------------------------------------------------

    def hold(self, session: bytes, size: int) -> None:
        self._bytes[session] = self._bytes.get(session, 0) + size

    def unhold(self, session: bytes, size: int) -> None:
        left = self._bytes.pop(session) - size
        if left:
            self._bytes[session] = left

    def single_taken(self, session: bytes, slot: int, size: int) -> None:
        """A RESERVED lease of the session took single slot ``slot`` and ``size`` bytes."""
        self.hold(session, size)
        self._singles[session] = self._singles.get(session, 0) + 1
        self._reserved.setdefault(session, set()).add(slot)

    def single_freed(self, session: bytes, size: int) -> None:
        """A lease of the session in a single slot ended: its slot and ``size`` bytes are back."""
        self.unhold(session, size)
        left = self._singles.pop(session) - 1
        if left:
            self._singles[session] = left

    def not_reserved(self, session: bytes, slot: int) -> None:
        """The session's lease in ``slot`` is RESERVED no more (published or freed)."""
        ids = self._reserved.get(session)
        if ids is not None:
            ids.discard(slot)
            if not ids:
                del self._reserved[session]

    def pop_reserved(self, session: bytes) -> set[int]:
        """The slots of the session's RESERVED leases, forgotten here (its process is gone)."""
        return self._reserved.pop(session, set())

    def hold_taken(self, session: bytes, slot: int) -> None:
        """A hold of the session took single slot ``slot`` (it counts toward max_session_leases)."""
        self._singles[session] = self._singles.get(session, 0) + 1
        self._holds.setdefault(session, set()).add(slot)

    def hold_ended(self, session: bytes, slot: int) -> None:
        left = self._singles.pop(session) - 1
        if left:
            self._singles[session] = left
        ids = self._holds.get(session)
        if ids is not None:
            ids.discard(slot)
            if not ids:
                del self._holds[session]

    def holds_of(self, session: bytes) -> set[int]:
        """The slots of the session's live holds (a copy)."""
        return set(self._holds.get(session, ()))
