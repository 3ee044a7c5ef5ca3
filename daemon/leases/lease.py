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
    RETAIN_EXPIRED = "its retain_ttl passed with no hold on it"
    EVICTED = "evicted: the pool needed its space and nothing held it"
    EVICTED_BY_KEY = "evicted by key"
    HOLDER_GONE = "a hold whose holder's session ended"
    DEDUPED = "another feature was published under its key first"
    UNWRITTEN = ("ended before its producer's GPU wrote it: whatever was read of it is incomplete; drop that "
                 "read and have the feature sent again")


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
    # Keys and lifetimes (daemon/leases/keys.py). ``key``: the key it is published under (bound from
    # its publish until it ends), with ``descriptor``, its bytes as lookups answer them.
    key: Optional[str] = None
    descriptor: Optional[bytes] = None
    # Set for a retained feature: kept after any number of reads, until this long after its publish
    # has passed and nothing holds it (``deadline`` then says when). None: counted, as ever.
    retain_ttl: Optional[float] = None
    holds: int = 0  # live holds on this retained feature: while any is, nothing frees it
    # Its pins (the ACKS word of a retained feature, protos/lease_table.py) as the daemon last read them:
    # reads outstanding, the ``taken`` count, and when that count was first seen (a pin it never saw
    # released is waited for until ack_ttl after that).
    pins: int = 0
    pins_taken: int = 0
    pinned_at: float = 0.0
    # Its free waits for its pins and the daemon filled its word (``taken`` at PIN_MAX, ``released``
    # raised by as much): no pin lands any more, and ``pinned_at`` no longer moves, whatever the word says.
    pins_frozen: bool = False
    # Why it ended while holds or pins protected it: it is freed, for that reason, when the last ends.
    doomed: Optional[EndReason] = None
    # Set for a hold: the retained feature whose bytes it protects (a hold owns no bytes of its own).
    hold_of: Optional["Lease"] = None
    # A client's reservation: once its reserve_ttl passes unpublished it is ``overdue``, and its range
    # is kept from every other feature while its session lives, since its producer may still be
    # writing there. Its publish is then refused; its release or its session's end frees it.
    keeps_range: bool = False
    overdue: bool = False
    # An arena feature published with the CONSUMERS word no acks reach (a retained one) whose ``bind``
    # has not arrived: no ack ends it, no key finds it, and it ends with its session or after ack_ttl.
    awaiting_bind: bool = False
    bound: bool = False  # an arena feature whose bind was applied (once)


# Why a slot's last generation ended, as stored per slot (one byte each): 0 while it never ended (or was
# never used).
END_REASONS = (None, *EndReason)
END_CODE = {reason: code for code, reason in enumerate(END_REASONS) if reason is not None}

# Called as observer(lease, reason, now) whenever a lease is freed; metrics and the mesh hang off it.
FreeObserver = Callable[[Lease, EndReason, float], None]
# Called with the number of features a sweep found published and acked by all since the last one:
# they end without ever being a live lease, so no FreeObserver sees them.
QuickObserver = Callable[[int], None]
