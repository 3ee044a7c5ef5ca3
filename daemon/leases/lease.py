"""A lease and the words for it: its state, why it ended, and who is told when it does.

Its own module so that the ledger's helpers (the expiry heap) and its observers (metrics, the mesh)
can name a lease without importing the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional

from .arenas import Arena


class LeaseState(str, Enum):
    RESERVED = "RESERVED"
    PUBLISHED = "PUBLISHED"


class EndReason(str, Enum):
    ACKED = "all acks received"
    RELEASED = "released by its producer"
    EXPIRED_RESERVED = "expired unpublished after reserve_ttl"
    EXPIRED_PUBLISHED = "expired waiting for acks after ack_ttl"
    RECLAIMED = "reclaimed: its producer disconnected before publishing"
    SHUTDOWN = "cut at daemon shutdown"
    REFUSED = "refused: its producer published it with words the daemon could not accept"
    CUT = "cut: its session wrote lease table words the daemon refused, past max_refused_words"


@dataclass
class Lease:
    lease_id: int
    gen: int
    pool_id: int
    offset: int
    nbytes: int
    token: bytes
    consumers: int
    remaining: int
    state: LeaseState
    session: bytes
    deadline: float
    reserved_at: float
    published_at: float = 0.0
    size: int = 0  # bytes it holds: nbytes rounded up to the lease alignment
    arena: Optional[Arena] = None  # set for a feature published in a producer arena
    # Ack ids already applied, so that a consumer's retry of an ack whose reply it lost counts once.
    ack_ids: Optional[set[bytes]] = None


# Why a slot's last generation ended, as stored per slot (one byte each): 0 while it never ended (or was
# never used).
END_REASONS = (None, *EndReason)
END_CODE = {reason: code for code, reason in enumerate(END_REASONS) if reason is not None}

# Called as observer(lease, reason, now) whenever a lease is freed; metrics and the mesh hang off it.
FreeObserver = Callable[[Lease, EndReason, float], None]
# Called with the number of features a sweep found published and acked by all since the last one:
# they end without ever being a live lease, so no FreeObserver sees them.
QuickObserver = Callable[[int], None]
