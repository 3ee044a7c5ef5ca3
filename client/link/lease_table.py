"""This process's view of the daemon's lease table (layout: mmfeat.protos.lease_table).

A consumer checks a descriptor here without a round trip and adds its acks here; a producer publishes
the features of its arenas here. Mapped once per daemon epoch and shared by the sessions of the process
that use it; unmapped once none does (held weakly, as client/link/mapping.py holds pools).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import threading
import weakref
from typing import Any, Callable, Optional

from mmfeat.atomics import FENCE_NEEDED, Words, fence_acquire
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.lease_table import (
    ACK_COUNT_MASK, ACK_GEN_MASK, ACKS, DONE, ENTRY_BYTES, FLAG_DRAINING, FREE, GEN_MASK, HEADER_FLAGS_WORD,
    LIVE_STATES, LOST_ACKS, PIN_MAX, PIN_RELEASED_SHIFT, POOL, PUBLISHED, READY, STATE, ack_word,
    is_ready, pins, state_word, table_bytes, word_offset,
)

STATE_FREE = FREE
# state() for a live lease whose pool, offset or size differ from what the descriptor says.
STATE_MISMATCH = -1

_U64 = struct.Struct("<Q")
# Compare-and-swap attempts on one ack word before the ack goes as a message: consumers acking the same
# feature at once retry a few times; only a peer that rewrites the word without end exhausts them.
_CAS_TRIES = 64
_ENTRY_HEAD = struct.Struct("<4Q")  # POOL, OFFSET, NBYTES, CONSUMERS
_ENTRY = struct.Struct("<4Q16s")  # POOL .. CONSUMERS, then TOKEN and TOKEN + 1 as the token's 16 bytes


def _read_word(mm: mmap.mmap, offset: int) -> int:
    return _U64.unpack_from(mm, offset)[0]


class LeaseTableView:
    def __init__(self, mm: mmap.mmap, slots: int, writable: bool) -> None:
        self._mm = mm
        self.slots = slots
        self.writable = writable
        self._words = Words(mm, 0, table_bytes(slots) // 8) if writable else None
        self._states = word_offset(slots, 0, STATE)
        self._acks = word_offset(slots, 0, ACKS)
        self._ready = word_offset(slots, 0, READY)
        self._entries = word_offset(slots, 0, POOL)
        # The table as GPU streams see it (client/gpu/ready_word.py), made on a GPU path's first use.
        self.gpu: Any = None
        # Acquire load of the word at a byte offset the caller checked; eight per feature, so bound once.
        # Neither refers back to this view: a dropped view is unmapped at once, not at the next GC.
        self._load: Callable[[int], int] = (self._words.load_at if self._words is not None
                                            else functools.partial(_read_word, mm))
        plain = self._words.plain_view() if self._words is not None else None
        self._states_q: Optional[memoryview] = None
        if plain is not None:
            # Where a plain load is an acquire load (x86-64), the STATE and ACKS columns as memoryviews:
            # indexing one reads a slot's word with no Python frame, and a put, get and ack read
            # several. These bound methods shadow the methods below (same results, any slot in range).
            first_state, first_ack = self._states // 8, self._acks // 8
            self._states_q = plain[first_state : first_state + slots]
            self.state_word = self._states_q.__getitem__  # type: ignore[method-assign]
            self._ack_word = plain[first_ack : first_ack + slots].__getitem__  # type: ignore[method-assign]

    def state(self, lease: int, gen: int, pool: int, offset: int, nbytes: int) -> int:
        """The lease's state if its slot holds generation ``gen`` live with this range; STATE_FREE if the
        generation is gone or DONE (every consumer acked: its producer may be writing over it), and
        STATE_MISMATCH if it is live with another range."""
        live = self._live_entry(lease, gen)
        if live is None:
            return STATE_FREE
        word, pool_, offset_, nbytes_, _ = live
        if pool_ != pool or offset_ != offset or nbytes_ != nbytes:
            return STATE_MISMATCH
        return word & 3

    def retained(self, lease: int, gen: int) -> bool:
        """Whether slot ``lease`` holds generation ``gen`` live as a retained feature (its CONSUMERS word
        is the count no acks reach): no reader's unacked share protects it, only a hold (whose slot is
        its own, with its count of readers)."""
        live = self._live_entry(lease, gen)
        return live is not None and live[4] == ACK_COUNT_MASK

    def _live_entry(self, lease: int, gen: int) -> Optional[tuple[int, int, int, int, int]]:
        """The STATE word and POOL, OFFSET, NBYTES, CONSUMERS of generation ``gen`` of slot ``lease``
        while it is RESERVED or PUBLISHED; None otherwise."""
        if not 0 <= lease < self.slots:
            return None
        load = self.state_word
        word = load(lease)
        if word >> 2 != gen or word & 3 not in LIVE_STATES:
            return None
        # The entry words were written before STATE named this generation (release store, acquire
        # load); reading STATE again, after a fence, proves they still belong to it (generations only
        # grow: no ABA; DONE and FREE only follow PUBLISHED).
        pool, offset, nbytes, consumers = _ENTRY_HEAD.unpack_from(self._mm, self._entries + ENTRY_BYTES * lease)
        if FENCE_NEEDED:
            fence_acquire()
        if load(lease) != word:
            return None
        return word, pool, offset, nbytes, consumers

    def pin(self, lease: int, gen: int, pool: int, offset: int, nbytes: int, count: int) -> bool:
        """Pin retained feature ``gen`` of slot ``lease`` (with exactly this range) for ``count`` reads: the
        daemon frees it only once each has been acked (as any ack of it: ``add_acks``) or ``ack_ttl`` has
        passed since it saw the pin. False, having pinned nothing, where the feature is not live and
        retained with this range, the daemon closed its word (it is ending it), or the word would pass
        PIN_MAX: the caller asks the daemon instead. The compare-and-swap is the decision: the daemon
        closes the word with one, so a pin that lands is one it sees before it frees the feature."""
        words = self._words
        if words is None or not 0 <= lease < self.slots or not 1 <= count <= PIN_MAX:
            return False
        at, want = self._acks + 8 * lease, gen & ACK_GEN_MASK
        seen = self._ack_word(lease)
        for _ in range(_CAS_TRIES):
            taken, _released, closed = pins(seen & ACK_COUNT_MASK)
            if seen >> 32 != want or closed or taken + count > PIN_MAX:
                return False
            live = self._live_entry(lease, gen)
            if (live is None or live[0] & 3 != PUBLISHED or live[1:4] != (pool, offset, nbytes)
                    or live[4] != ACK_COUNT_MASK):
                return False
            ok, seen = words.cas_at(at, seen, seen + count)
            if ok:
                return True
        return False

    def add_acks(self, lease: int, gen: int, pool: int, offset: int, nbytes: int, count: int) -> bool:
        """Add ``count`` acks to the lease's ack word if its slot still holds generation ``gen`` live with
        exactly this range; False if not (the feature ended, the slot holds another one) or the word
        would overflow. The ack that completes the consumer count also turns STATE from PUBLISHED to
        DONE, which lets the producer reuse the space before the daemon's next sweep. The caller checks
        the daemon's epoch: slots and generations start again after a restart. Both compare-and-swaps
        are sequentially consistent: ordered after this thread's reads of the feature, on aarch64 too.
        For a retained feature an ack releases one of its pins (``pin``); False where none is taken."""
        words = self._words
        if words is None or not 0 <= lease < self.slots:
            return False
        at = self._acks + 8 * lease
        want = gen & ACK_GEN_MASK
        seen = self._ack_word(lease)
        load, mm, entry = self.state_word, self._mm, self._entries + ENTRY_BYTES * lease
        for _ in range(_CAS_TRIES):  # bounded: under a peer that rewrites the word without end, send a message
            if seen >> 32 != want or (seen & ACK_COUNT_MASK) + count > ACK_COUNT_MASK:
                return False
            # _live_entry, inline (every consumer acks every feature): False where it would give None,
            # since then the lease ended and the daemon says why (a message ack).
            word = load(lease)
            if word >> 2 != gen or word & 3 not in LIVE_STATES:
                return False
            pool_, offset_, nbytes_, consumers = _ENTRY_HEAD.unpack_from(mm, entry)
            if FENCE_NEEDED:
                fence_acquire()
            if load(lease) != word:
                return False
            if pool_ != pool or offset_ != offset or nbytes_ != nbytes:
                return False  # another range: the daemon says why
            add = count
            if consumers == ACK_COUNT_MASK:
                # A retained feature: an ack releases one of its pins, never more than were taken (a
                # stray release would cancel a later pin that still protects a read).
                taken, released, closed = pins(seen & ACK_COUNT_MASK)
                if closed or released + count > taken:
                    return False
                add = count << PIN_RELEASED_SHIFT
            ok, seen = words.cas_at(at, seen, seen + add)
            if ok:
                if (seen & ACK_COUNT_MASK) + count >= consumers and word & 3 == PUBLISHED:
                    # The last ack: a failed swap means the daemon ended it meanwhile, which is as good.
                    words.cas_at(self._states + 8 * lease, word, (gen & GEN_MASK) << 2 | DONE)
                return True
        return False

    def publish(self, slot: int, gen: int, pool: int, offset: int, nbytes: int, consumers: int, token: bytes,
                ready: bool = True) -> None:
        """Publish a feature written in the caller's arena: its words, then STATE with a release store
        (ordered after the payload writes and these words). ``ready`` False: a GPU stream writes READY
        behind the write (client/gpu/ready_word.py); else it is stored here, before STATE."""
        assert self._words is not None
        # Plain stores: the release store of STATE below orders every earlier store of this thread.
        _ENTRY.pack_into(self._mm, self._entries + ENTRY_BYTES * slot, pool, offset, nbytes, consumers, token)
        _U64.pack_into(self._mm, self._acks + 8 * slot, ack_word(gen))
        if ready:
            _U64.pack_into(self._mm, self._ready + 8 * slot, gen & GEN_MASK)
        if self._states_q is not None:
            self._states_q[slot] = state_word(gen, PUBLISHED)  # a plain store is a release store here
        else:
            self._words.store_at(self._states + 8 * slot, state_word(gen, PUBLISHED))

    def state_word(self, slot: int) -> int:
        """The STATE word of a slot the caller checked is in range (its own arena's, one the daemon
        granted)."""
        return self._load(self._states + 8 * slot)

    def is_ready(self, slot: int, gen: int) -> bool:
        """Whether the slot's READY word says generation ``gen``'s bytes are complete; ``slot`` in range.
        Once it does, this thread's later reads and the GPU work it queues next are ordered after the
        load (an acquire: a plain load where it is not one needs the fence, on aarch64)."""
        ready = is_ready(self._load(self._ready + 8 * slot), gen)
        if ready and FENCE_NEEDED and self._words is None:
            fence_acquire()  # a read-only mapping's loads are plain ones (_read_word)
        return ready

    def lost(self, slot: int, gen: int) -> bool:
        """Whether generation ``gen`` of ``slot`` ended before its producer's GPU wrote it: the daemon
        marks its ACKS word so (``LOST_ACKS``) with its FREE, and a read of it was a lost read."""
        if not 0 <= slot < self.slots:
            return False
        return (self.state_word(slot) == state_word(gen, FREE)
                and self._ack_word(slot) == ack_word(gen, LOST_ACKS))

    def mark_ready(self, slot: int, gen: int) -> None:
        """Store ``gen`` in a reserved lease's READY word (a release store, after the payload's writes),
        so that its consumers need not wait for the daemon to handle the pipelined publish that also
        stores it. Only where the table is mapped writable; ``slot`` is the daemon's grant."""
        if self._words is not None and 0 <= slot < self.slots:
            self._words.store_at(self._ready + 8 * slot, gen & GEN_MASK)

    def ready_offset(self, slot: int) -> int:
        """Where the slot's READY word is, in bytes from the start of the mapping."""
        if not 0 <= slot < self.slots:
            raise IndexError(slot)
        return self._ready + 8 * slot

    @property
    def mm(self) -> mmap.mmap:
        return self._mm

    def _ack_word(self, slot: int) -> int:
        return self._load(self._acks + 8 * slot)

    def draining(self) -> bool:
        return bool(_U64.unpack_from(self._mm, 8 * HEADER_FLAGS_WORD)[0] & FLAG_DRAINING)


_lock = threading.Lock()
# Weakly, as client/link/mapping.py holds pools: the sessions using a table hold it.
_tables: "weakref.WeakValueDictionary[tuple[str, int], LeaseTableView]" = weakref.WeakValueDictionary()


def _new_lock_in_child() -> None:
    # A thread of the parent mapping a table at the fork holds the lock in the child for good, as in
    # client/link/mapping.py: the child's first session would wait for it forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def map_lease_table(endpoint: str, epoch: int, fd: int, slots: int, writable: bool) -> LeaseTableView:
    """Map the lease table behind ``fd`` (closing ``fd`` either way), once per daemon epoch. Writable
    when this process publishes and acks in it; read-only for the message path."""
    try:
        with _lock:
            hit = _tables.get((endpoint, epoch))
            if hit is not None and (hit.writable or not writable):
                return hit
            size = table_bytes(slots)
            # Only the size is checked, and it is what matters: the daemon sealed it. The shape comes from
            # hello, never from the header, which every member of the group maps read-write and may have
            # rewritten (the daemon puts it back on its next sweep; SPEC.md, section 9).
            if os.fstat(fd).st_size < size:
                raise MmfeatError(ErrorCode.INTERNAL, f"the lease table mmfeatd sent is {os.fstat(fd).st_size} B, "
                                  f"not the {size} B of its hello: report it")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
            for key in [k for k in _tables if k[0] == endpoint]:
                _tables.pop(key, None)  # an older epoch's table: unmapped once nothing uses it
            view = LeaseTableView(mm, slots, writable)
            _tables[(endpoint, epoch)] = view
            return view
    finally:
        os.close(fd)
