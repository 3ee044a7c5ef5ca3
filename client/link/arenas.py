"""Producer arenas: slices of the pool the daemon granted this process ahead of need.

``put`` places a feature in an arena and publishes it in the lease table, with no message to the
daemon. Each arena is used as a ring: space is taken at the head and comes back at the tail once the
oldest feature is over: DONE (its last consumer acked, and said so in STATE) or FREE (the daemon ended
it: all acks, or expiry). The slot of a DONE feature comes back later, once the daemon has written FREE.
Space that comes back at the last ack, not at the daemon's next sweep, keeps the ring short, so the
features in flight stay in the CPU caches, and keeps a ring of a few large features from filling.
A feature that does not fit goes to the next arena, or reserves; a new arena is asked for without
waiting when the current one runs low, and arenas unused for ``IDLE_S`` go back to the pool. A retained
feature ends only at its retain_ttl or an eviction: an arena whose ring it blocks goes back as soon as
a feature finds no room there, so that it holds no producer up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from mmfeat.protos.descriptor import LEASE_ALIGNMENT
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.handshake import ArenaGrant
from mmfeat.protos.lease_table import ACK_COUNT_MASK, DONE, GEN_MASK, PUBLISHED
from mmfeat.protos.messages import ArenaReply

from .fd_transport import FdTransport
from .lease_table import LeaseTableView

log = logging.getLogger("mmfeat.client")

IDLE_S = 5.0
# A feature larger than this fraction of an arena reserves instead: a ring holding one huge feature
# would serialise the producer behind its slowest consumer.
MAX_FEATURE_FRACTION = 0.5
_LOW_WATER = 0.5  # ask for the next arena once the current one is this full
_RETRY_S = 1.0  # after a refused arena request (pool full, limit reached)
# Refusals that giving back an arena of another size class may cure: the session's arena count or
# bytes (OVER_QUOTA), the pool's share for arenas (POOL_FULL).
_ROOM_ERRORS = (ErrorCode.OVER_QUOTA, ErrorCode.POOL_FULL)


def _class_of(arena: "ProducerArena", usual: Optional[int]) -> int:
    """The size-class key of ``arena``: 0 for the usual size, else its size."""
    return 0 if arena.size == usual else arena.size


def _size_class(nbytes: int) -> int:
    """The arena size the daemon grants for a feature over half the usual arena (SPEC.md, ``arena``):
    features of one class share their arenas, and a refused class does not hold up the others."""
    return 1 << (2 * nbytes - 1).bit_length()


@dataclass(slots=True)
class Placement:
    arena: "ProducerArena"
    slot: int
    gen: int
    offset: int  # in the pool
    start: int  # in the arena
    end: int
    published: bool = False
    abandoned: bool = False
    # The slot's STATE word while the feature is live and once its last consumer acked: reclaim
    # compares with these on every put.
    live_word: int = 0
    done_word: int = 0
    # Published behind a GPU stream's write (READY word): its space is not taken back before the word
    # is written, whatever its consumers acked, so a write still queued never lands under the next.
    by_stream: bool = False
    retained: bool = False  # no ack ends it: its space comes back only at its retain_ttl, or an eviction


def _drop(p: "Placement") -> None:
    """Give back a placement the put will not write (it falls back): a range left placed but never
    published would stop its arena's ring there, and keep the reaper from returning the arena, for good."""
    p.abandoned = True
    p.arena.reclaim()


class ProducerArena:
    """One arena, used as a ring. Not thread-safe: ArenaSet holds the lock."""

    def __init__(self, grant: ArenaGrant, table: LeaseTableView) -> None:
        if grant.slot_base + grant.slots > table.slots:
            raise MmfeatError(ErrorCode.INTERNAL, f"the daemon granted slots {grant.slot_base}+{grant.slots} of a "
                              f"{table.slots}-slot table")
        self.arena_id = grant.id
        self.pool = grant.pool
        self.offset = grant.offset
        self.size = grant.size
        self._table = table
        self._free_slots = list(range(grant.slot_base + grant.slots - 1, grant.slot_base - 1, -1))
        self._slot_base = grant.slot_base
        # The last generation each slot had when this arena was installed, then the last one this
        # producer gave it: a peer of the group can write a lower one into a free slot's STATE, and a
        # generation the daemon has seen already would be refused.
        self._last_gen = [table.state_word(slot) >> 2 for slot in range(grant.slot_base, grant.slot_base + grant.slots)]
        self._ring: deque[Placement] = deque()
        self._done: deque[Placement] = deque()  # space back, slot not yet: the daemon has not written FREE
        self.used = 0
        self.last_used = time.monotonic()
        self.retired = 0  # slots left out for good: see place()
        self._slots = grant.slots
        # The most this ring has had in flight lately (bytes): it goes back to the arena's start only
        # once the start holds that much (see _fit). Decays by 1/256 a put.
        self._peak = 0

    def reclaim(self) -> None:
        """Take back the space and slots of the oldest features that are over."""
        ring, state_word, done = self._ring, self._table.state_word, self._done
        if not done and ring:
            # The usual put: the oldest feature still live, nothing waiting for FREE; one load.
            p = ring[0]
            if p.published and state_word(p.slot) == p.live_word:
                return
        while done and state_word(done[0].slot) != done[0].done_word:
            self._free_slots.append(done.popleft().slot)
        while ring:
            p = ring[0]
            if p.abandoned:
                self._free_slots.append(p.slot)
            elif not p.published:
                return  # still being written
            else:
                word = state_word(p.slot)
                if word == p.live_word:
                    return  # still live
                if p.by_stream and not self._table.is_ready(p.slot, p.gen):
                    return  # acked, or ended, before its GPU wrote it: the copy may still be queued
                if word == p.done_word:
                    done.append(p)
                else:
                    self._free_slots.append(p.slot)
            ring.popleft()
            self.used -= p.end - p.start

    def place(self, nbytes: int) -> Optional[Placement]:
        size = -(-nbytes // LEASE_ALIGNMENT) * LEASE_ALIGNMENT  # leases start LEASE_ALIGNMENT apart
        self.reclaim()  # one load when nothing ended: reuse the freshest space and slots first
        free = self._free_slots
        start = self._fit(size) if free else None
        if start is None:
            return None
        last_gen, state_word = self._last_gen, self._table.state_word
        while True:
            slot = free.pop()
            # The daemon wrote FREE with this slot's last generation; the next feature takes the one above
            # (above this producer's own last one too, whatever a peer wrote there meanwhile).
            i = slot - self._slot_base
            gen = state_word(slot) >> 2
            gen = (gen if gen > last_gen[i] else last_gen[i]) + 1
            if gen <= GEN_MASK:
                last_gen[i] = gen
                break
            # Every generation of the slot is spent: a peer of the group wrote the highest one (SPEC.md,
            # section 9). A wrapped generation would be refused, and its feature lost: retire the slot.
            self.retired += 1
            if self.retired == 1:
                log.warning("lease slot %d of arena %d has no generation left (a peer of the group wrote the "
                            "highest); retiring such slots", slot, self.arena_id)
            if not free:
                return None
        p = Placement(self, slot, gen, self.offset + start, start, start + size, False, False,
                      gen << 2 | PUBLISHED, gen << 2 | DONE)  # state_word(gen, ...): gen <= GEN_MASK
        self._ring.append(p)
        self.used += size
        self._peak = max(self.used, self._peak - (self._peak >> 8))
        self.last_used = time.monotonic()
        return p

    def _fit(self, size: int) -> Optional[int]:
        ring = self._ring
        if not ring:
            return 0 if size <= self.size else None
        head, tail = ring[-1].end, ring[0].start
        if head > tail:  # one stretch in use, [tail, head): room at the start, or after it
            # Back to the start once it holds what is in flight and this feature: the features in flight
            # then cycle through low addresses, which stay in the CPU cache, instead of through the whole
            # arena. Not sooner: once wrapped, the ring has only [head, tail) until its oldest feature
            # ends, and a ring wrapped into the first feature's room alone fills whenever an ack lags
            # (a consumer's background acker), sending the producer to another arena with this one empty.
            ahead = head + size <= self.size
            if size <= tail and (not ahead or tail >= self._peak + size):
                return 0
            return head if ahead else None
        return head if head + size <= tail else None  # wrapped: room only in [head, tail)

    def pinned(self) -> bool:
        """Whether the oldest feature still live is a retained one: nothing comes back to this ring until
        its retain_ttl passes or it is evicted, and until then the ring takes only what fits before it."""
        self.reclaim()
        p = self._ring[0] if self._ring else None
        return p is not None and p.retained and p.published and self._table.state_word(p.slot) == p.live_word

    def low(self) -> bool:
        """Past half its bytes, or half its slots under live features (a burst of small features runs out
        of slots first)."""
        return (self.used > self.size * _LOW_WATER
                or len(self._free_slots) + len(self._done) < self._slots * _LOW_WATER)

    def writing(self) -> bool:
        """Whether a put is still writing a feature here (placed, not yet published or abandoned)."""
        return any(not p.published and not p.abandoned for p in self._ring)

    def returnable(self) -> bool:
        """Whether it may go back now: no put writing here, and no GPU write still queued into it (a
        feature published behind its stream whose READY word is behind, acked already or not). The
        daemon keeps such a feature's range out of the pool all the same; kept here, the arena goes
        back whole once the write lands, not trimmed around it."""
        is_ready = self._table.is_ready
        return not any((not p.published and not p.abandoned) or (p.by_stream and not is_ready(p.slot, p.gen))
                       for p in self._ring)


def _spare(low: ProducerArena, fitting: list[ProducerArena]) -> bool:
    """Whether an arena of ``fitting`` other than ``low`` is under its low water. Arenas a burst filled
    stay in the set until their features end: counting them as room would let the next arena be asked
    for only once the last one is full, and the feature that finds it full reserve meanwhile."""
    for a in fitting:
        if a is not low:
            a.reclaim()  # what its consumers finished since a put last looked there counts as room
            if not a.low():
                return True
    return False


class ArenaSet:
    """The arenas of one session, by pool: they live in ``table`` and are asked for and returned on
    the session's fd channel. Safe to share between threads."""

    def __init__(self, table: LeaseTableView, fd: FdTransport) -> None:
        self._table = table
        self._fd = fd
        self._lock = threading.Lock()
        self._arenas: dict[int, list[ProducerArena]] = {}
        # (pool, size class: 0 for the usual arena) -> id of an arena request whose reply has not been read
        self._pending: dict[tuple[int, int], int] = {}
        self._retry_at: dict[tuple[int, int], float] = {}
        self._usual: dict[int, int] = {}  # pool -> size of the arenas the daemon grants for any feature
        self._stop = threading.Event()
        self._reaper: Optional[threading.Thread] = None

    def place(self, pool: int, device: Optional[int], nbytes: int) -> Optional[Placement]:
        """Space for ``nbytes`` in one of this session's arenas of ``pool``; None: reserve instead. A
        feature over half the usual arena goes to an arena of its own size class, asked for with its
        size, so that it too costs no message."""
        if self._table.draining():
            return None
        with self._lock:
            if self._pending:
                self._collect(pool)
            arenas = self._arenas.get(pool)
            if arenas:
                p = self._place_first(pool, device, nbytes, arenas)
                if p is not None:
                    return p
            return self._place_slow(pool, device, nbytes, arenas)

    def place_now(self, pool: int, nbytes: int) -> Optional[Placement]:
        """place() of a host feature where it waits for nothing: in the arena that took the last feature,
        with no arena reply to read first; None where place() has more to do."""
        if self._pending or self._table.draining():
            return None
        with self._lock:
            arenas = self._arenas.get(pool)
            return self._place_first(pool, None, nbytes, arenas) if arenas else None

    def _place_first(self, pool: int, device: Optional[int], nbytes: int,
                     arenas: list[ProducerArena]) -> Optional[Placement]:
        """The usual put: the arena that had room last time takes this feature too. The slow path tries
        the arenas in the same order, so this changes which arena only in cost."""
        first = arenas[0]
        if nbytes > first.size * MAX_FEATURE_FRACTION:
            return None
        p = first.place(nbytes)
        if p is not None and first.low():
            try:
                self._ask_ahead(pool, device, nbytes, first, arenas)
            except BaseException:  # the daemon is gone: the caller falls back, and this space comes back
                _drop(p)
                raise
        return p

    def _place_slow(self, pool: int, device: Optional[int], nbytes: int,
                    arenas: Optional[list[ProducerArena]]) -> Optional[Placement]:
        """place() past its first arena: a session's first feature, a new size class, a full arena."""
        if pool not in self._usual:
            if not self._request(pool, device, None, wait=True):  # a session's first feature: one round trip
                return None
            arenas = self._arenas.get(pool)
            if pool not in self._usual:
                return None
        large = nbytes if nbytes > self._usual[pool] * MAX_FEATURE_FRACTION else None
        fitting = [a for a in arenas or () if nbytes <= a.size * MAX_FEATURE_FRACTION]
        if not fitting and large is not None:
            # The first feature of its size class waits for its arena, as a session's first does.
            self._request(pool, device, large, wait=True)
            arenas = self._arenas.get(pool)
            fitting = [a for a in arenas or () if nbytes <= a.size * MAX_FEATURE_FRACTION]
        for arena in fitting:
            p = arena.place(nbytes)
            if p is None and arena.pinned() and arena.returnable():
                # Returned, its retained features stay readable, each range going back to the pool when
                # it ends, and evictable as any there; the next arena asked for takes new features.
                self._arenas[pool].remove(arena)
                self._fd.send("arena_return", arena=arena.arena_id)
            if p is not None:
                assert arenas is not None
                if arena is not arenas[0]:  # keep the arena that had room first next time
                    arenas.remove(arena)
                    arenas.insert(0, arena)
                if arena.low() and not _spare(arena, fitting):  # the next one, before this one fills
                    try:
                        self._request(pool, device, large, wait=False)
                    except BaseException:  # as in _place_first: the put falls back, its space comes back
                        _drop(p)
                        raise
                return p
        self._request(pool, device, large, wait=False)
        return None

    def _ask_ahead(self, pool: int, device: Optional[int], nbytes: int, low: ProducerArena,
                   arenas: list[ProducerArena]) -> None:
        """Ask for the next arena of ``nbytes``'s class while ``low``, which took this feature, runs low
        and no other arena that takes the class has room to spare."""
        if not _spare(low, [a for a in arenas if nbytes <= a.size * MAX_FEATURE_FRACTION]):
            large = nbytes if nbytes > self._usual[pool] * MAX_FEATURE_FRACTION else None
            self._request(pool, device, large, wait=False)

    def publish(self, p: Placement, nbytes: int, consumers: int, token: bytes, ready: bool = True) -> None:
        """Make a placed feature visible: its lease-table entry, then its STATE word. ``ready`` False:
        its GPU stream writes the slot's READY word behind the write. ``consumers`` ACK_COUNT_MASK: a
        retained feature, which no count of acks ends."""
        p.by_stream = not ready
        p.retained = consumers == ACK_COUNT_MASK
        self._table.publish(p.slot, p.gen, p.arena.pool, p.offset, nbytes, consumers, token, ready)
        # Not under the lock: a KeyboardInterrupt while waiting for it would leave a feature that STATE shows
        # published counted as being written, and its ring would stop there for good. One attribute store
        # is atomic; made after the STATE store, it is all reclaim needs.
        p.published = True

    def abandon(self, p: Placement) -> None:
        """The feature was never published (its write failed): its space and slot come back."""
        p.abandoned = True  # before the lock, for the same reason as in publish: any reclaim takes it back
        with self._lock:
            p.arena.reclaim()

    def _request(self, pool: int, device: Optional[int], nbytes: Optional[int], wait: bool) -> bool:
        """Ask for an arena of ``pool`` that takes features of ``nbytes`` (None: the usual size); with
        ``wait``, install it before returning. Whether a request went out."""
        key = (pool, _size_class(nbytes) if nbytes is not None else 0)
        if key in self._pending or time.monotonic() < self._retry_at.get(key, 0.0):
            return False
        fields: dict[str, Any] = {"device": device} if device is not None else {}
        if nbytes is not None:
            fields["nbytes"] = nbytes
        try:
            if wait:
                try:
                    self._install(key, self._fd.call("arena", **fields))
                except MmfeatError as exc:
                    if exc.code not in _ROOM_ERRORS or not self._give_back_oldest(pool, key, 0.0):
                        raise
                    self._install(key, self._fd.call("arena", **fields))
            else:
                self._pending[key] = self._fd.call_later("arena", **fields)
        except DaemonUnavailableError:
            # The producer falls back at once instead of waiting again for a reserve. The puts queued for
            # this lock behind this one do not ask again, each waiting out a timeout of its own: they place
            # their features without the next arena.
            self._retry_at[key] = time.monotonic() + _RETRY_S
            raise
        except MmfeatError as exc:  # pool full, limit reached, too large, draining: reserve meanwhile
            self._refused(key, exc)
        return True

    def _give_back_oldest(self, pool: int, key: tuple[int, int], idle_s: float) -> bool:
        """Return the least recently used arena of ``pool`` of another size class than ``key``'s, unused
        for ``idle_s`` and none of it being written, so that ``key``'s class can have one; whether one
        went back. Without this a session at its arena limit (or its share of the pool) would reserve
        every feature of a new size class that its arenas cannot hold until an old arena went idle for
        IDLE_S. Its features stay readable: a returned arena takes no new feature, and the daemon frees
        it once they are over (and written: an arena a GPU write is still queued into stays)."""
        cutoff = time.monotonic() - idle_s
        others = [a for a in self._arenas.get(pool, ()) if _class_of(a, self._usual.get(pool)) != key[1]
                  and a.last_used <= cutoff and a.returnable()]
        if not others:
            return False
        oldest = min(others, key=lambda a: a.last_used)
        self._arenas[pool].remove(oldest)
        self._fd.send("arena_return", arena=oldest.arena_id)  # handled before the request that follows it
        return True

    def _collect(self, pool: int) -> None:
        for key in [k for k in self._pending if k[0] == pool]:
            req_id = self._pending[key]
            try:
                reply = self._fd.reply_to(req_id)
            except MmfeatError as exc:  # DaemonUnavailableError too: the put reserves, and learns
                del self._pending[key]
                self._refused(key, exc)
                continue
            if reply is not None:
                del self._pending[key]
                self._install(key, reply)

    def _refused(self, key: tuple[int, int], exc: Exception) -> None:
        # An arena asked for ahead of need was refused: an arena of another class that has not been used
        # for a while goes back, and the next put asks again, rather than its class reserving meanwhile.
        if (isinstance(exc, MmfeatError) and exc.code in _ROOM_ERRORS
                and self._give_back_oldest(key[0], key, _RETRY_S)):
            return
        self._retry_at[key] = time.monotonic() + _RETRY_S
        log.debug("no arena (size class %d) in pool %d for now: %s", key[1], key[0], exc)

    def _install(self, key: tuple[int, int], reply: dict[str, Any]) -> None:
        grant = ArenaReply.from_wire(reply).arena
        pool, size_class = key
        if not size_class:
            self._usual[pool] = grant.size
        self._arenas.setdefault(pool, []).append(ProducerArena(grant, self._table))
        if self._reaper is None:
            # The thread holds the set weakly: a Client dropped without close() must still end, and with
            # it this set, its fd channel and its session at the daemon. Collecting the set wakes it.
            self._reaper = threading.Thread(target=_reap_idle, args=(weakref.ref(self), self._stop),
                                            name="mmfeat-arenas", daemon=True)
            weakref.finalize(self, _stop_in_owner, self._stop, os.getpid())
            self._reaper.start()

    def reap_idle(self) -> bool:
        """Give back arenas unused for IDLE_S, so an idle producer does not hold pool space; False once
        the session is over."""
        cutoff = time.monotonic() - IDLE_S
        with self._lock:
            idle = [(pool, a) for pool, arenas in self._arenas.items() for a in arenas
                    if a.last_used < cutoff and a.returnable()]  # a long write, or a GPU's queued, keeps it
            for pool, arena in idle:
                self._arenas[pool].remove(arena)
        for _, arena in idle:
            try:
                self._fd.send("arena_return", arena=arena.arena_id)
            except DaemonUnavailableError:
                return False  # the session is over: the daemon returned every arena of it
        return True

    def give_back_all(self, timeout: float) -> None:
        """Return every arena, those still being granted too, and wait (up to ``timeout``) until the
        daemon has taken them: a closed client holds no pool space beyond features still being read."""
        self._stop.set()
        with self._lock:
            ids = [a.arena_id for pool in self._arenas.values() for a in pool]
            pending = list(self._pending.values())
            self._arenas.clear()
            self._pending.clear()
        try:
            if pending:
                self._fd.sync(timeout)  # the daemon answers in order: their replies are in now
            for req_id in pending:
                try:
                    reply = self._fd.reply_to(req_id)
                except DaemonUnavailableError:
                    raise
                except MmfeatError:
                    continue  # refused: nothing to return
                if reply is not None:
                    ids.append(ArenaReply.from_wire(reply).arena.id)
            for arena_id in ids:
                self._fd.send("arena_return", arena=arena_id)
            if ids:
                self._fd.sync(timeout)
        except DaemonUnavailableError:
            pass  # gone or restarted: the daemon takes a closed session's arenas back itself

    def close(self) -> None:
        self._stop.set()


def _stop_in_owner(stop: threading.Event, pid: int) -> None:
    # A forked child has no reaper thread to stop, and the event's lock may be one a parent thread held
    # at the fork: setting it there could wait for ever.
    if os.getpid() == pid:
        stop.set()


def _reap_idle(owner: "weakref.ref[ArenaSet]", stop: threading.Event) -> None:
    while not stop.wait(IDLE_S / 4):
        arenas = owner()
        if arenas is None or not arenas.reap_idle():
            return
        del arenas  # not held while waiting
