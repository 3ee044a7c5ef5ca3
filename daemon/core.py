"""The daemon's state: pools, their allocators, the ledger, sessions, counters. No sockets here."""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any, Callable, Collection, Optional, Protocol, Sequence

import numpy as np

from mmfeat import atomics
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.messages import LeaseRef

from .config import Settings
from .leases.allocator import Allocator
from .leases.arenas import Arenas
from .leases.counters import Counters
from .leases.lease import FreeObserver, QuickObserver
from .leases.lease_table import FEW_SLOTS, LeaseTable
from .leases.ledger import Ledger
from .leases.session_books import SessionBooks
from .leases.sessions import ATTACH_GRACE_S, PeerCred, SessionTable
from .leases.slots import SlotSpace
from .leases.sweeper import Sweeper
from .pools import Pool

log = logging.getLogger("mmfeatd")
_CUT_LOG_EVERY_S = 10.0


# Called once with a reply body (dict) or the MmfeatError the request ended with.
Respond = Callable[[Any], None]


class Remote(Protocol):
    """What the handlers ask of a daemon's mesh (mesh/remote.py's RemoteFeatures). A Protocol, so that a
    daemon without a mesh names it without importing any of the mesh's code."""

    def get(self, node: str, ref: LeaseRef, timeout: float, respond: Optional[Respond], now: float,
            into_pool: Optional[int] = None, pull: bool = False, hold: Optional[tuple[bytes, int]] = None) -> None:
        """Make node ``node``'s feature ``ref`` readable here; ``respond`` None: a prefetch; ``pull``: pull
        it even where its FABRIC handle could be relayed (the client's import of that failed); ``hold``:
        (session, readers), answered with a hold over the pulled copy for that many readers."""

    def relay_ack(self, node: str, ref: LeaseRef, count: int, ack_id: Optional[bytes], respond: Optional[Respond],
                  now: float) -> None:
        """Hand ``count`` acks of node ``node``'s feature ``ref`` to its daemon."""


class DaemonCore:
    def __init__(self, settings: Settings, pools: list[Pool], observer: Optional[FreeObserver] = None,
                 quick_observer: Optional[QuickObserver] = None) -> None:
        self.settings = settings
        self.pools = {p.pool_id: p for p in pools}
        # Told of every freed lease: metrics, and the mesh (copies of other nodes' features; peers that
        # pulled one of ours).
        self.free_observers: list[FreeObserver] = [observer] if observer is not None else []
        # Changes every start, so descriptors from a previous run are refused as STALE.
        self.epoch = secrets.randbits(62)
        self.started = time.monotonic()
        self.counters = Counters()
        self.sessions = SessionTable()
        self.draining = False
        self.sessions_dropped_logged_at = float("-inf")  # a hello flood is logged at most every 10 s
        self.endpoint = ""
        self.feed_endpoint = ""  # set by the server once its key feed listens (hello's feed)
        # Set when metrics are on: called with the seconds each reserve took inside the daemon.
        self.observe_reserve: Optional[Callable[[float], None]] = None
        # Set by the server: its connection counts and limits, for stats.
        self.resource_stats: Callable[[], dict] = dict
        # Set by the server when it runs a mesh: its peers, for stats (None without one).
        self.mesh_stats: Callable[[], Optional[dict]] = lambda: None
        # Set by the server when it runs a mesh: gets and acks of other nodes' features (daemon/mesh/remote.py).
        self.remote: Optional[Remote] = None
        self.table = LeaseTable(settings.max_leases, self.epoch)
        allocators = {p.pool_id: Allocator(p.size) for p in pools}
        space = SlotSpace(settings.max_leases, min(settings.arena_slots, settings.max_leases))
        self.books = SessionBooks(self.counters, settings.max_session_mb << 20, settings.max_session_leases)
        self.arenas = Arenas(allocators, space, self.counters, self.books, settings.arena_mb << 20,
                             settings.arenas_per_session)
        self.ledger = Ledger(
            allocators,
            self.epoch,
            self.counters,
            settings.reserve_ttl,
            settings.ack_ttl,
            space,
            self.arenas,
            self.books,
            self.free_observers,  # the list itself: the server adds the mesh's later
            self.table,
            [quick_observer] if quick_observer is not None else [],
        )
        self.ledger.gpu_pools = frozenset(p.pool_id for p in pools if p.kind == "cuda")
        # How producers publish GPU features (hello, stats): behind their stream's write where nothing
        # reads the pool but clients whose streams wait on READY. A mesh's pulls read the bytes with
        # NIXL, which waits on no stream, so a daemon with one asks for the host wait.
        self.gpu_publish = "ready_word" if settings.gpu_publish == "auto" and not settings.listen else "host_wait"
        self.ledger.unwritten.ready_ttl = settings.ready_ttl
        self.sweeper = Sweeper(self.table, self.ledger)
        self.sweeper.charge = self._charge
        # Set by the server: closes a cut session's fd channel (without ending the session again).
        self.close_channel: Callable[[bytes], None] = lambda token: None
        # Set by the server: handles every request already waiting on the fd channels. A lookup that
        # missed calls it, so that a bind sent before the lookup was (daemon/handlers.py) is never missed.
        self.read_waiting: Callable[[], None] = lambda: None
        self._cut_logged_at = float("-inf")
        # Arenas need compare-and-swap in the lease table (clients ack there): without libatomic, every
        # feature takes the message path.
        self.arenas_enabled = settings.arena_mb > 0 and atomics.AVAILABLE

    def sweep(self, now: float, defer_unacked: bool = False, slots: Optional[Collection[int]] = None,
              blocks: Sequence[tuple[int, int]] = ()) -> int:
        """Apply what clients wrote into the lease table; the number of words applied. ``slots`` (slot
        numbers) and ``blocks`` (``[lo, hi)`` ranges) sweep those alone; ``slots`` None, the whole table.
        Sweeper.sweep says what ``defer_unacked`` leaves for the next sweep.

        A request's sweep of its own slots first compares their words, and the header, with what the
        daemon last accounted for, in a few word loads: where nothing changed, a sweep would apply
        nothing, and none runs (``sweeps_skipped``). Over a few slots whose changed words are all in
        slots of live features, the sweep runs word by word (Sweeper.sweep_held)."""
        applied = None
        if slots is not None:
            few = not blocks and len(slots) <= FEW_SLOTS
            changed = self.table.changed(slots) if few else None
            quiet = not changed if few else self.table.unchanged(slots, blocks)
            if quiet and self.table.header_intact(self.draining):
                self.counters.sweeps_skipped += 1
                return 0
            if changed and not defer_unacked:
                applied = self.sweeper.sweep_held(changed, now)
        if applied is None:
            picked = None
            if slots is not None:
                picked = np.concatenate([np.fromiter(slots, dtype=np.int64, count=len(slots)),
                                         *(np.arange(lo, hi, dtype=np.int64) for lo, hi in blocks)])
            applied = self.sweeper.sweep(now, defer_unacked, picked)
        if self.table.keep_header(self.draining):
            self.counters.bad_table_words += 1
        for token in self.sweeper.take_over():
            self.cut_session(token, now)
        return applied

    def sweep_lease(self, now: float, ref: LeaseRef) -> None:
        """Sweep the one slot a request's lease names: a feature published or acked there since the last
        sweep is known to the reply, and no other session's words are read for it."""
        if 0 <= ref.lease < self.table.slots:
            self.sweep(now, slots=(ref.lease,))

    def sweep_session(self, now: float, token: bytes, defer_unacked: bool = False, also: Sequence[int] = ()) -> None:
        """Sweep the slots a session holds by the daemon's records (its reserved leases, its holds, its
        arenas' blocks), and ``also`` these, in one sweep: words refused there may cut it, and acks there
        give back its quota."""
        slots = [*self.books.slots_of(token), *also]
        blocks = [(a.slot_base, a.slot_base + a.slots) for a in self.arenas.of_session(token)]
        self.sweep(now, defer_unacked, slots, blocks)

    def _charge(self, token: bytes) -> bool:
        """A table word refused in a slot the session holds; True once it is past max_refused_words."""
        session = self.sessions.get(token)
        if session is None:
            return False  # ended already: what it left ends by ack or expiry
        session.refused += 1
        return session.refused > self.settings.max_refused_words

    def cut_session(self, token: bytes, now: float) -> None:
        """The session's slots kept holding words the daemon refused: it is cut. Its leases end, its
        arenas go back, its fd channel is closed, and a request that names it is told SESSION_CUT."""
        session = self.sessions.cut(token)
        leases, arenas = self.ledger.cut_session(token, now)
        self.close_channel(token)
        self.counters.sessions_cut += 1
        self.counters.leases_cut += leases
        if now - self._cut_logged_at >= _CUT_LOG_EVERY_S:
            self._cut_logged_at = now
            who = f"{session.name!r} (pid {session.node_pid})" if session is not None else "a session"
            log.warning("cut %s: lease table words in slots it holds were refused past max_refused_words (%d); "
                        "%d lease(s) ended, %d arena(s) taken back, its fd channel closed (%d session(s) cut so "
                        "far; SPEC.md section 9)", who, self.settings.max_refused_words, leases, arenas,
                        self.counters.sessions_cut)

    def set_draining(self) -> None:
        self.draining = True
        self.table.set_draining(True)  # producers stop placing features in their arenas

    def apply_settings(self, settings: Settings) -> None:
        """Take reloaded settings. TTLs apply to leases reserved or published from now on."""
        self.settings = settings
        self.ledger.reserve_ttl = settings.reserve_ttl
        self.ledger.ack_ttl = settings.ack_ttl
        self.ledger.unwritten.ready_ttl = settings.ready_ttl
        self.books.quota_bytes = settings.max_session_mb << 20

    def pool_for(self, device: Optional[int]) -> int:
        if device is None:
            return next(iter(self.pools))
        for pool in self.pools.values():
            if pool.device == device:
                return pool.pool_id
        devices = sorted(p.device for p in self.pools.values())
        raise MmfeatError(ErrorCode.NOT_FOUND, f"no pool on device {device}; this daemon has pools on {devices}")

    def close(self) -> None:
        self.table.close()

    def authorize_fds(self, token: bytes, peer: PeerCred) -> tuple[list[int], list[int]]:
        """Called by the fd channel: check the peer and its session, attach it, return the fds to send."""
        if not self.settings.uid_allowed(peer.uid, set(peer.groups) | {peer.gid}):
            raise MmfeatError(
                ErrorCode.FORBIDDEN,
                f"uid {peer.uid} may not use this daemon; add it to allowed_uids or its group to allowed_gids",
            )
        session = self.sessions.get(token)
        if session is None:
            self.check_not_cut(token)
            raise MmfeatError(ErrorCode.NOT_FOUND, "unknown session: send hello on the control socket first")
        if session.attached:
            raise MmfeatError(ErrorCode.BAD_STATE, "this session already has an fd channel")
        self.sessions.attach(token, peer)
        ids, fds = [], []
        for pool in self.pools.values():
            fd = pool.export_fd()
            if fd is not None:
                ids.append(pool.pool_id)
                fds.append(fd)
        fds.append(self.table.fd)  # always last: the lease table (SPEC.md, section 5)
        return ids, fds

    def check_not_cut(self, token: bytes) -> None:
        """Raise SESSION_CUT if the daemon cut this session."""
        if self.sessions.was_cut(token):
            raise MmfeatError(ErrorCode.SESSION_CUT, "the daemon cut this session: lease table words in slots it held "
                              "were refused past max_refused_words, and its leases ended; open a new session, and "
                              "stop whatever writes into the table")

    def end_session(self, token: bytes) -> int:
        """The session's fd channel closed: its process is gone or done. Adopt what it published in its
        arenas, reclaim what it left RESERVED, and give its arenas back (each is freed once no feature
        in it is live)."""
        now = time.monotonic()
        self.sweep(now)
        self.sessions.close(token)
        self.arenas.give_back_session(token)
        self.ledger.end_holds(token, now)  # a dead holder's readers are not waited for
        return self.ledger.reclaim_session(token, now)

    def tick(self, now: float) -> None:
        self.ledger.expire(now)
        self.sessions.drop_unattached_before(now - ATTACH_GRACE_S)

    def stats(self) -> dict:
        self.sweep(time.monotonic())  # exact as of this reply: what clients wrote so far is applied
        arenas = self.arenas
        pools = []
        for pool in self.pools.values():
            alloc = self.ledger.allocators[pool.pool_id]
            arena_bytes = arenas.bytes[pool.pool_id]
            pools.append(
                {
                    "pool": pool.pool_id,
                    "kind": pool.kind,
                    "device": pool.device,
                    "handle": pool.handle,
                    "gpu_direct_rdma": pool.rdma,
                    "capacity": alloc.capacity,
                    "used": alloc.used,
                    "free": alloc.free,
                    "largest_free": alloc.largest_free,
                    "leases": self.ledger.count_by_state(pool.pool_id),
                    "bytes": self.ledger.bytes_by_state(pool.pool_id),
                    # used = bytes of leases outside arenas + arena bytes; live_bytes is in both.
                    "arenas": {"count": arenas.count(pool.pool_id), "bytes": arena_bytes,
                               "live_bytes": arenas.live_bytes[pool.pool_id], "slack": arenas.slack(pool.pool_id)},
                }
            )
        return {
            "node": self.settings.node_id,
            "pid": os.getpid(),
            "epoch": self.epoch,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "draining": self.draining,
            "gpu_publish": self.gpu_publish,
            "unwritten": len(self.ledger.unwritten),
            "clients": self.sessions.attached_count(),
            "sessions": len(self.sessions),
            "leases": self.ledger.count_by_state(),
            "timers": self.ledger.timers,
            "swept_slots": self.ledger.space.swept,
            "pools": pools,
            "counters": self.counters.as_dict(),
            "limits": self.resource_stats(),
            "mesh": self.mesh_stats(),
            "namespaces": self.ledger.keys.stats(),
            "holds": self.ledger.holds_live,
            "pins": sum(lease.pins for lease in self.ledger.pinned.values()),
            "expired_reserved": self.ledger.overdue,
        }
