"""The lease table: one entry per lease slot in a sealed memfd that every client maps. The layout is
mmfeat.protos.lease_table.

Consumers read it to check a descriptor without a round trip and add their acks to it; producers
publish the features of their arenas in it. The daemon creates it, writes the entries of the leases
it reserves and every FREE, and sweeps it (daemon/leases/sweeper.py) for what clients wrote. It holds no
feature bytes; the daemon still never touches those.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
from typing import Collection, Optional

import numpy as np

from mmfeat.atomics import FENCE_NEEDED, PLAIN_ORDERED, Words, fence_acquire
from mmfeat.protos.lease_table import (
    ACKS, ENTRY_BYTES, ENTRY_WORDS, FREE, GEN_MASK, HEADER, HEADER_BYTES, HEADER_FLAGS_WORD, LOST_ACKS, MAGIC,
    NOT_READY, POOL, PUBLISHED, READY, STATE, ack_word, is_ready, state_word, table_bytes, word_offset,
)

_ENTRY = struct.Struct(f"<{ENTRY_WORDS}Q")
# Up to this many slots, ``changed`` reads word by word in Python: a request's handful of slots costs a few
# hundred nanoseconds that way, where numpy's calls on small arrays cost microseconds each, cache-cold.
FEW_SLOTS = 32


class LeaseTable:
    def __init__(self, slots: int, epoch: int) -> None:
        self.slots = slots
        self.size = table_bytes(slots)
        self._fd: Optional[int] = os.memfd_create("mmfeat-leases", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, self.size)
        self._mm: Optional[mmap.mmap] = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED)
        self._epoch = epoch
        self._headers = (self._header(False), self._header(True))  # the daemon's own, not draining and draining
        self._mm[:HEADER_BYTES] = self._headers[0]
        # Clients map it writable (they publish and ack in it), so only its size is sealed: a client
        # cannot shrink it under the daemon's mapping (SIGBUS) or grow it.
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.words = Words(self._mm, 0, self.size // 8)
        # The sweeper's bulk views of the two columns clients write.
        self.states = np.frombuffer(self._mm, dtype="<u8", count=slots, offset=word_offset(slots, 0, STATE))
        self.acks = np.frombuffer(self._mm, dtype="<u8", count=slots, offset=word_offset(slots, 0, ACKS))
        # READY words: the daemon stores a slot's generation there before each FREE (a GPU stream waiting
        # on a feature that ended would otherwise wait for good) and reads them to count features that
        # ended before their producer's GPU had written them.
        self.ready = np.frombuffer(self._mm, dtype="<u8", count=slots, offset=word_offset(slots, 0, READY))
        self.ready[:] = NOT_READY
        # Every slot's entry as a row of words (POOL .. TOKEN + 1), for the sweep's batch checks.
        self.entries = np.frombuffer(self._mm, dtype="<u8", count=slots * ENTRY_WORDS,
                                     offset=word_offset(slots, 0, POOL)).reshape(slots, ENTRY_WORDS)
        # What the daemon last wrote or accounted for in each STATE and ACKS word; a sweep looks at the
        # words that differ (daemon/leases/sweeper.py).
        self.seen_state = np.zeros(slots, dtype=np.uint64)
        self.seen_acks = np.zeros(slots, dtype=np.uint64)
        # The same words as Python ints, for ``unchanged`` over a few slots: plain loads, as the sweep's
        # column copies are (it decides only whether to sweep; the sweep reads again, in order).
        self._plain: Optional[memoryview] = memoryview(self._mm).cast("Q")
        self._seen_words = (memoryview(self.seen_state).cast("B").cast("Q"),
                            memoryview(self.seen_acks).cast("B").cast("Q"))
        self._columns = (word_offset(slots, 0, STATE) // 8, word_offset(slots, 0, ACKS) // 8)
        # Where the STATE column and the entries start: the sweep writes a STATE and reads an entry per
        # feature.
        self._states_at = word_offset(slots, 0, STATE)
        self._entries_at = word_offset(slots, 0, POOL)

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RuntimeError("lease table is closed")
        return self._fd

    def address(self) -> int:
        """Where the table is mapped in this process: registered with NIXL so that peers can check a
        feature they pulled (its STATE word and entry) without a message."""
        assert self._mm is not None
        view = ctypes.c_char.from_buffer(self._mm)
        addr = ctypes.addressof(view)
        del view  # a live export would keep the mapping from ever closing
        return addr

    def entry(self, slot: int) -> tuple[int, ...]:
        """The slot's POOL .. TOKEN + 1 words, read plainly: call after an acquire (load or fence) that
        saw its STATE."""
        assert self._mm is not None
        return _ENTRY.unpack_from(self._mm, self._entries_at + ENTRY_BYTES * slot)

    def _offset(self, slot: int, word: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(slot)
        return word_offset(self.slots, slot, word)

    def load(self, slot: int, word: int) -> int:
        return self.words.load_at(self._offset(slot, word))

    def set(self, slot: int, gen: int, state: int, ready: bool = True, lost: bool = False) -> None:
        """A new state for the generation in the slot (publish of a reserved lease), or FREE. Both store
        READY first, unless ``ready`` is False: a publish whose producer's GPU stream writes READY
        itself, or the FREE of a feature that GPU has not written yet (daemon/leases/unwritten.py),
        which ``lost`` marks so before the FREE: a reader that sees the FREE sees the mark."""
        if lost:
            self.mark_lost(slot, gen)
        if ready:
            self.ready[slot] = gen & GEN_MASK  # a plain store: the STATE store below releases it
        self.store_state(slot, state_word(gen, state))

    def is_ready(self, slot: int, gen: int) -> bool:
        return is_ready(int(self.ready[slot]), gen)

    def mark_lost(self, slot: int, gen: int) -> None:
        """The ACKS word of a generation that ends before its producer's GPU wrote it (its FREE follows):
        every reader can tell a read of it was lost (SPEC.md, section 5)."""
        word = ack_word(gen, LOST_ACKS)
        self.seen_acks[slot] = word  # the daemon's own word: no sweep takes it for a client's acks
        self.words.store_at(self._offset(slot, ACKS), word)

    def store_state(self, slot: int, word: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(slot)
        self.seen_state[slot] = word
        self.words.store_at(self._states_at + 8 * slot, word)

    def free_many(self, slots: np.ndarray, gens: np.ndarray, ready: bool = True) -> None:
        """FREE in the STATE words of ``slots`` (generations ``gens``), and before it their generation
        in READY unless ``ready`` is False (features every consumer acked whose READY is written already:
        the sweep ends those whose GPU has not written them as leases). The caller ordered its reads of
        those slots before this (an acquire fence after them)."""
        gens = gens & np.uint64(GEN_MASK)
        words = gens << np.uint64(2) | np.uint64(FREE)
        self.seen_state[slots] = words
        if ready:
            self.ready[slots] = gens  # before FREE: a stream waiting on the feature goes on (see __init__)
        if PLAIN_ORDERED:
            # x86-64: each element is one aligned 8-byte move, a release store there (mmfeat.atomics).
            self.states[slots] = words
            return
        for slot, word in zip(slots.tolist(), words.tolist()):
            self.words.store_at(self._states_at + 8 * slot, word)

    def restore_states(self, slots: np.ndarray) -> None:
        """Put the daemon's own STATE words back in ``slots``, over words clients wrote there."""
        words = self.seen_state[slots]
        if PLAIN_ORDERED:
            self.states[slots] = words  # as in free_many: each element one aligned 8-byte store
            return
        for slot, word in zip(slots.tolist(), words.tolist()):
            self.words.store_at(self._states_at + 8 * slot, word)

    def set_live(self, slot: int, gen: int, state: int, pool: int, offset: int, nbytes: int, consumers: int,
                 token: bytes) -> None:
        """A reserved lease goes live: its words first, then the state word that names its generation."""
        assert self._mm is not None
        # Plain stores: the release store of STATE below orders them all before it.
        _ENTRY.pack_into(self._mm, word_offset(self.slots, slot, POOL), pool, offset, nbytes, consumers,
                         int.from_bytes(token[:8], "little"), int.from_bytes(token[8:16], "little"))
        self.seen_acks[slot] = ack_word(gen)
        self.words.store_at(self._offset(slot, ACKS), ack_word(gen))
        if state == PUBLISHED:  # a hold: its bytes are its base feature's, complete already
            self.ready[slot] = gen & GEN_MASK
        self.store_state(slot, state_word(gen, state))

    def changed(self, slots: Collection[int]) -> list[tuple[int, int, int]]:
        """The slots among a few ``slots`` (slot numbers; any outside the table are skipped, as no sweep
        reads them) whose STATE or ACKS word differs from what the daemon last accounted for
        (``seen_*``), each once, in slot order, with its ACKS and STATE words as read: ACKS first, then
        (after an acquire fence) STATE, as the sweep reads them."""
        assert self._plain is not None
        words, (seen_state, seen_acks), (states_at, acks_at) = self._plain, self._seen_words, self._columns
        n, out = self.slots, []
        for slot in slots:
            if 0 <= slot < n:
                acks = words[acks_at + slot]
                if FENCE_NEEDED:
                    fence_acquire()
                state = words[states_at + slot]
                if acks != seen_acks[slot] or state != seen_state[slot]:
                    out.append((slot, acks, state))
        if len(out) > 1:
            out = sorted(dict((slot, (slot, acks, state)) for slot, acks, state in out).values())
        if out and FENCE_NEEDED:
            fence_acquire()  # the entries a sweep reads next come after the STATE words that named them
        return out

    def unchanged(self, slots: Collection[int], blocks: Collection[tuple[int, int]] = ()) -> bool:
        """Whether the STATE and ACKS words of ``slots`` (as for ``changed``) and of each block ``[lo, hi)``
        are what the daemon last accounted for: a sweep of them would then find nothing to apply."""
        if len(slots) <= FEW_SLOTS:
            if self.changed(slots):
                return False
        else:
            picked = np.fromiter(slots, dtype=np.int64, count=len(slots))
            picked = picked[(picked >= 0) & (picked < self.slots)]
            if not (np.array_equal(self.acks[picked], self.seen_acks[picked])
                    and np.array_equal(self.states[picked], self.seen_state[picked])):
                return False
        for lo, hi in blocks:
            if (self.acks[lo:hi].tobytes() != self.seen_acks[lo:hi].tobytes()
                    or self.states[lo:hi].tobytes() != self.seen_state[lo:hi].tobytes()):
                return False
        return True

    def cas(self, slot: int, word: int, expected: int, new: int) -> tuple[bool, int]:
        return self.words.cas(self._offset(slot, word) // 8, expected, new)

    def set_draining(self, draining: bool) -> None:
        self.words.store(HEADER_FLAGS_WORD, 1 if draining else 0)

    def _header(self, draining: bool) -> bytes:
        return HEADER.pack(MAGIC, self._epoch, self.slots, ENTRY_BYTES, 1 if draining else 0).ljust(HEADER_BYTES, b"\0")

    def header_intact(self, draining: bool) -> bool:
        """Whether the header is the daemon's own (``keep_header`` would change nothing)."""
        assert self._mm is not None
        return self._mm[:HEADER_BYTES] == self._headers[draining]

    def keep_header(self, draining: bool) -> bool:
        """Put back a header a client rewrote (every member maps the table read-write); whether it had
        to. Clients take the table's shape from hello, not from here, so a rewritten header misleads
        nobody but a reader of the DRAINING flag, until this runs."""
        if self.header_intact(draining):
            return False
        want = self._headers[draining]
        for i in range(HEADER_BYTES // 8):
            self.words.store(i, int.from_bytes(want[8 * i: 8 * i + 8], "little"))
        return True

    def close(self) -> None:
        if self._mm is not None:
            self.words.close()
            del self.states, self.acks, self.ready, self.entries
            if self._plain is not None:
                self._plain.release()
                self._plain = None
            self._mm.close()
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
