"""The lease table's layout, shared by the daemon and every client. SPEC.md, section 5.

A 64-byte header, then four regions: the STATE word of every slot, the ACKS word of every slot, the
READY word of every slot, and a 48-byte entry per slot with the rest. The STATE and ACKS columns are
dense so that the daemon's sweep reads 16 bytes per slot, not a cache line (payload copies of many MiB
evict the table from the caches between sweeps); READY is a column of its own, which GPU streams
write and wait on and the sweep never reads. Every word is a little-endian uint64 at an 8-byte-aligned
offset, so each is read and written whole; ``word_offset`` says where.

Words of a slot:

- ``STATE``: ``generation << 2 | state``. The feature's owner writes it last, with a release store:
  the daemon for slots of reserved leases, the producer for slots of its arena when it publishes.
  The consumer whose ack completes the count (``CONSUMERS``) turns ``PUBLISHED`` into ``DONE`` with a
  compare-and-swap: the feature is over, and its producer may reuse the space at once, before the
  daemon's next sweep has accounted for it. The daemon writes ``FREE`` when it ends the feature; that
  store hands an arena slot back to its producer, who may then reuse the slot (with a higher
  generation). Readers treat ``DONE`` as ended.
- ``ACKS``: ``(generation mod 2**32) << 32 | acks``. Consumers add their acks with compare-and-swap,
  and only while the high half names the generation they hold, so a late ack never counts for the
  next feature in the slot. The daemon sweeps this column and applies what it finds. A GPU feature
  that ended before its producer's GPU wrote it has ``acks`` = ``LOST_ACKS`` (all ones) with its FREE
  STATE, until the slot is reused: a read of it was a lost read, and every client can tell.
  A *retained* feature (``CONSUMERS`` = ``ACK_COUNT_MASK``: no count of acks ends it) uses the low half
  for its *pins* instead: ``taken`` in bits 0-14, ``released`` in bits 16-30, ``PIN_CLOSED`` (bit 31).
  A pin protects the feature for a number of reads without a message: a holder adds them to ``taken``
  with compare-and-swap (only while the word names the generation, is not closed and ``taken`` stays
  within ``PIN_MAX``), and each reader's ack adds one to ``released`` (only while ``released`` stays
  at or below ``taken``). The daemon ends a retained feature only after it closed the word with a
  compare-and-swap from a value with no pin outstanding (``taken == released``), or from any value
  once ``ack_ttl`` has passed since it first saw the current ``taken``; both sides swap the same word,
  so a pin either lands before the close (and the daemon waits for it) or fails (and its holder asks
  the daemon). A feature whose free waits for its pins has its word filled first (``taken`` to
  ``PIN_MAX``, ``released`` raised by as much): no pin lands after that, and a rewrite of the word no
  longer moves the end of the wait. The daemon folds a settled word back to zero pins.
- ``POOL``, ``OFFSET``, ``NBYTES``, ``CONSUMERS``: the live feature's range and consumer count,
  written before ``STATE`` names its generation.
- ``TOKEN``, ``TOKEN + 1``: the feature's 16-byte token, which ack, release and lookup messages
  must present.
- ``READY``: the generation whose bytes are complete. A feature of generation ``g`` is ready once
  ``READY - g`` (mod 2**64, read as signed) is not negative: the comparison a GPU stream's
  ``cuStreamWaitValue64(GEQ)`` makes. A producer that waited for its write stores ``g`` before its
  STATE store (the daemon does, for a reserved lease, when the publish arrives); one that publishes
  without waiting has its GPU stream write ``g`` behind the write. The daemon stores the slot's
  generation before every FREE it writes, so no stream waits forever on a feature that ended. It
  starts as all ones: ready for no generation.

Header words: magic, epoch, slots, entry bytes, flags (``FLAG_DRAINING``: producers stop using
their arenas), then zeros.
"""

from __future__ import annotations

import struct

MAGIC = b"MMFTABL5"
HEADER = struct.Struct("<8sQQQQ")  # magic, epoch, slots, entry bytes, flags; zero-padded to HEADER_BYTES
HEADER_BYTES = 64
HEADER_FLAGS_WORD = 4  # index of the flags word among the header's words
FLAG_DRAINING = 1
STATE, ACKS, POOL, OFFSET, NBYTES, CONSUMERS, TOKEN = range(7)
READY = 8  # a column of its own, not an entry word (TOKEN + 1 is the entry's last)
NOT_READY = (1 << 64) - 1  # READY's first value: ready for no generation below 2**63
ENTRY_WORDS = 6  # POOL, OFFSET, NBYTES, CONSUMERS, TOKEN, TOKEN + 1
ENTRY_BYTES = 8 * ENTRY_WORDS
FREE, RESERVED, PUBLISHED, DONE = 0, 1, 2, 3
LIVE_STATES = (RESERVED, PUBLISHED)  # DONE: every consumer acked, the producer may be reusing the space
GEN_MASK = (1 << 62) - 1
ACK_GEN_MASK = 0xFFFF_FFFF
ACK_COUNT_MASK = 0xFFFF_FFFF
LOST_ACKS = ACK_COUNT_MASK  # the ACKS count of a freed generation whose GPU never wrote it (a lost read)
# A retained feature's ACKS count: pins taken (bits 0-14) and released (bits 16-30), and the daemon's close.
PIN_MAX = 0x7FFF
PIN_RELEASED_SHIFT = 16
PIN_CLOSED = 1 << 31


def pins(acks: int) -> tuple[int, int, bool]:
    """A retained feature's ACKS count as (taken, released, closed)."""
    return acks & PIN_MAX, acks >> PIN_RELEASED_SHIFT & PIN_MAX, bool(acks & PIN_CLOSED)


COLUMN_BYTES = 24  # STATE, ACKS and READY: 8 bytes each per slot


def table_bytes(slots: int) -> int:
    return HEADER_BYTES + slots * (COLUMN_BYTES + ENTRY_BYTES)


def word_offset(slots: int, slot: int, word: int) -> int:
    """Byte offset, from the start of a table of ``slots`` slots, of word ``word`` of slot ``slot``."""
    if word == STATE:
        return HEADER_BYTES + 8 * slot
    if word == ACKS:
        return HEADER_BYTES + 8 * (slots + slot)
    if word == READY:
        return HEADER_BYTES + 8 * (2 * slots + slot)
    return HEADER_BYTES + COLUMN_BYTES * slots + ENTRY_BYTES * slot + 8 * (word - POOL)


def is_ready(ready: int, gen: int) -> bool:
    """Whether a READY word says generation ``gen``'s bytes are complete (the GPU's GEQ comparison)."""
    return (ready - (gen & GEN_MASK)) & (1 << 64) - 1 < 1 << 63


def state_word(gen: int, state: int) -> int:
    return (gen & GEN_MASK) << 2 | state


def ack_word(gen: int, acks: int = 0) -> int:
    return (gen & ACK_GEN_MASK) << 32 | acks


def check_entry(state: int, entry: bytes, gen: int, pool: int, offset: int, nbytes: int, token: bytes) -> str:
    """Why a slot's STATE word and 48-byte entry, as read from another process or node, do not show the
    live feature ``gen`` with this range and token; "" when they do. The entry is written before STATE
    names its generation and rewritten only after the slot was freed, so an entry read after a STATE
    naming ``gen`` either belongs to it or to a later feature, whose token differs."""
    if state >> 2 != gen & GEN_MASK or state & 3 not in LIVE_STATES:
        return "STALE"
    pool_, offset_, nbytes_ = struct.unpack_from("<QQQ", entry, 0)
    if (pool_, offset_, nbytes_) != (pool, offset, nbytes) or entry[32:48] != token:
        return "FORBIDDEN"
    return ""
