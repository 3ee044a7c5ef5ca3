"""The control loop: a ZMQ ROUTER for requests, the fd channel for handles, a tick for expiry, signals.

SIGTERM/SIGINT drain (no new reserves; published leases get ``drain_timeout`` seconds to be acked),
a second one stops at once. SIGHUP reloads what can change without a restart.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import zmq

from mmfeat.protos.codec import MAX_REQUEST_BYTES
from mmfeat.protos.envelope import error_frame
from mmfeat.protos.errors import ErrorCode
from mmfeat.protos.paths import CONTROL_SOCKET, control_endpoint, fd_socket_path

from .cadence import IDLE_WAKE_S, MESH_TICK_S, SWEEP_MAX_S, SWEEP_MIN_S, TICK_S, sweep_interval
from .config import MAX_PEERS, Settings
from .core import DaemonCore
from .dispatch import dispatch
from .sd_notify import Notifier
from .sockets.budgets import FD_RESERVE, MemoryGuard, client_budget, malloc_trim, raise_fd_limit
from .sockets.control_socket import ControlSocket
from .sockets.fd_channel import FdChannel
from .sockets.key_feed import KeyFeed, open_key_feed
from .sockets.memory_watch import MemoryWatch
from .timers import Timers

if TYPE_CHECKING:
    from .mesh.peers import Mesh
    from .mesh.puller import Puller
    from .mesh.remote import RemoteFeatures
    from .metrics import Metrics  # prometheus-client is imported only by a daemon that serves metrics

log = logging.getLogger("mmfeatd")

# A drain serves at least this long, sweeping, whatever is live (see _drain_step).
DRAIN_SETTLE_S = 0.05
STATUS_EVERY_S = 5.0
METRICS_EVERY_S = 0.5
TRIM_EVERY_S = 10.0
_MAX_BATCH = 256
# Plain ints: pyzmq's flag enums cost a few microseconds per operation on the per-request path.
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)

Reload = Callable[[], None]
T = TypeVar("T")


class Server:
    def __init__(
        self,
        core: DaemonCore,
        notifier: Optional[Notifier] = None,
        metrics: Optional[Metrics] = None,
        reload: Optional[Reload] = None,
    ) -> None:
        self.core = core
        # What the server holds, closed in the reverse order it was taken: the mesh's sockets before the
        # context they belong to, which waits for every socket of its own to close.
        self._exit = contextlib.ExitStack()
        self.notifier = notifier or Notifier({})
        self._exit.callback(self.notifier.close)
        self.metrics = self._hold("metrics", metrics, lambda m: m.close()) if metrics is not None else None
        self._reload = reload
        self._stop_requests = 0
        self._reload_requested = False
        self._drain_deadline: Optional[float] = None
        self._ctx: Optional[zmq.Context] = None
        self._control: Optional[ControlSocket] = None
        self._feed: Optional[KeyFeed] = None  # None where it could not listen: the daemon serves without it
        self._fds: Optional[FdChannel] = None
        self._guard: Optional[MemoryGuard] = None
        self._wake: tuple[socket.socket, ...] = ()  # the signal wake-up pair, while serve() runs
        self._watch: Optional[MemoryWatch] = None  # the memory guard's thread, while serve() runs
        self._mesh: Optional[Mesh] = None
        self._puller: Optional[Puller] = None
        self._remote: Optional[RemoteFeatures] = None
        self._fabric_domain: Optional[dict] = None  # the NVLink domain this node announces to its peers
        self._fd_limit = 0

    @property
    def settings(self) -> Settings:  # reload replaces core.settings; always read the current one
        return self.core.settings

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._stop_requests += 1

    def _on_hup(self, signum: int, frame: object) -> None:
        self._reload_requested = True

    def bind(self) -> None:
        runtime = self.settings.runtime_dir
        fd_limit = self._fd_limit = raise_fd_limit()
        clients = client_budget(fd_limit, self.settings.max_clients)
        self._ctx = self._hold("_ctx", zmq.Context(), zmq.Context.term)
        # The daemon's own sockets only (connections are not sockets): a few, and per mesh peer its DEALER
        # and the two ends of that DEALER's monitor; a source other than the static list may list up to
        # MAX_PEERS.
        peers = len(self.settings.peers) if self.settings.peers_from == "static" else MAX_PEERS
        self._ctx.set(zmq.MAX_SOCKETS, 64 + 3 * peers)
        self._fds = self._hold("_fds", FdChannel(
            fd_socket_path(runtime), self.settings.socket_mode, self.core.authorize_fds, self._on_fd_close,
            lambda session, frame: dispatch(self.core, frame, session=session), clients,
        ), FdChannel.close)
        # Connections share half the fds the clients leave (the other half lets a burst outrun the caps'
        # threads): a quarter of that share for the key feed, whose subscribers are a node's schedulers.
        connections = max(1, (fd_limit - FD_RESERVE) // 2 - clients)
        feed_connections = max(1, connections // 4)
        self._control = self._hold("_control", ControlSocket(
            self._ctx, runtime / CONTROL_SOCKET, control_endpoint(runtime), self.settings.socket_mode,
            max(1, connections - feed_connections), self._owns, self._peer_arrived,
        ), ControlSocket.close)
        self._open_feed(runtime, feed_connections)
        self.core.endpoint = self._control.endpoint
        self.core.close_channel = self._fds.drop_session
        self.core.read_waiting = self._fds.read_waiting
        self.core.resource_stats = self._resource_stats
        if self.settings.listen:
            # Imported only here: the mesh's modules (ZeroMQ's authenticator, asyncio) are a tenth of a
            # daemon's start-up, which a daemon without a mesh need not pay.
            from .mesh.peers import Mesh
            from .mesh.remote import RemoteFeatures

            no_puller = self._start_puller()
            if any(p.handle == "fabric" for p in self.core.pools.values()):
                from .pools.fabric_probe import pools_fabric_domain

                self._fabric_domain = pools_fabric_domain(self.core.pools.values())
            self._mesh = self._hold("_mesh", Mesh(self._ctx, self.settings, self._mesh_hello, self._owns), Mesh.close)
            self._remote = RemoteFeatures(self.core, self._mesh, self._puller, no_puller, self._fabric_domain)
            self._mesh.handler = self._remote
            self.core.remote = self._remote
            self.core.free_observers.append(self._remote.on_free)
            self.core.mesh_stats = self._mesh_stats
        self._guard = self._hold("_guard", MemoryGuard(self.settings.control_memory_mb << 20), MemoryGuard.close)
        log.info("fd limit %d: up to %d clients and %d control connections",
                 fd_limit, clients, self._control.max_connections)

    def _open_feed(self, runtime: Path, max_connections: int) -> None:
        feed = open_key_feed(self._ctx, runtime, self.settings.socket_mode, max_connections, self._owns)
        if feed is None:
            return
        keys = self.core.ledger.keys

        def close(f: KeyFeed) -> None:
            # Detached first: leases cut or freed after the loop ends unbind their keys into no closed socket.
            keys.feed, self.core.feed_endpoint = None, ""
            f.close()

        self._feed = self._hold("_feed", feed, close)
        keys.feed, self.core.feed_endpoint = feed.publish, feed.endpoint

    def _resource_stats(self) -> dict:
        assert self._control is not None and self._fds is not None
        feed = self._feed
        return {
            "fd_limit": self._fd_limit,
            "max_clients": self._fds.max_clients,
            "max_connections": self._control.max_connections,
            "connections": self._control.connections,
            "connections_refused": self._control.refused + self._fds.refused + (feed.refused if feed else 0),
            "control_resets": self._control.resets,
            "max_feed_connections": feed.max_connections if feed is not None else 0,
            "feed_connections": feed.connections if feed is not None else 0,
        }

    def _start_puller(self) -> str:
        """NIXL, with every pool it can register; what a client is told if it cannot start ("" if it did)."""
        from mmfeat.nixl import NixlUnavailable

        from .mesh.data_plane import choose_devices, explain
        from .mesh.puller import Puller, Region, agent_name

        regions = []
        for pool in self.core.pools.values():
            try:
                mapped = pool.map_for_pulls()
            except (OSError, RuntimeError) as exc:  # CudaError is a RuntimeError
                log.warning("mesh: pool %d cannot be mapped for pulls (%s); its features go to other nodes inline",
                            pool.pool_id, exc)
                continue
            if mapped is not None:
                regions.append(Region(pool.pool_id, mapped[0], pool.size, mapped[1], mapped[2]))
        try:
            if not regions:
                raise NixlUnavailable("no pool of this daemon can be registered with NIXL")
            devices = choose_devices(self.settings.listen, self.settings.data_devices)
            try:
                self._puller = self._hold("_puller", Puller(
                    agent_name(self.settings.node_id, self.core.epoch), regions,
                    (self.core.table.address(), self.core.table.size), devices), Puller.close)
            except NixlUnavailable as exc:
                raise explain(exc, devices) from None
        except NixlUnavailable as exc:
            log.warning("mesh: features of other nodes cannot be pulled here: %s", exc)
            return f"this daemon cannot pull features from other nodes: {exc}"
        return ""

    def _mesh_hello(self) -> dict:
        regions = self._puller.regions if self._puller is not None else {}
        pools = []
        for p in self.core.pools.values():
            info = {k: v for k, v in p.info(self.core.epoch).to_wire().items() if k not in ("epoch", "uuid")}
            info["addr"] = regions[p.pool_id].addr if p.pool_id in regions else 0
            pools.append(info)
        return {"node": self.settings.node_id, "epoch": self.core.epoch, "pools": pools,
                "nixl": self._puller.metadata if self._puller is not None else None,
                "table": {"addr": self._puller.table_addr, "slots": self.core.table.slots}
                if self._puller is not None and self._puller.table_addr else None,
                "fabric_domain": self._fabric_domain}

    def _mesh_stats(self) -> dict:
        assert self._mesh is not None and self._remote is not None
        stats = self._mesh.stats() | self._remote.stats()
        for peer in stats["peers"]:
            if peer["public_key"] is not None:  # a peer listed without a key has no counters
                peer.update(self._remote.peer_counters(peer["public_key"]).as_dict())
        return stats

    def _owns(self, fd: int) -> bool:
        """An fd of the daemon's own, which the control socket's connection cap must never shut down."""
        return (self._fds is not None and self._fds.owns(fd)) or any(fd == end.fileno() for end in self._wake)

    def _on_fd_close(self, token: bytes) -> None:
        n = self.core.end_session(token)
        if n:
            log.info("a client disconnected with %d unpublished lease(s); reclaimed", n)

    def _status(self) -> str:
        s = self.core
        used = sum(a.used for a in s.ledger.allocators.values()) >> 20
        cap = sum(a.capacity for a in s.ledger.allocators.values()) >> 20
        state = "draining" if s.draining else "serving"
        return f"{state}: {s.sessions.attached_count()} client(s), {s.ledger.live} lease(s), {used}/{cap} MiB used"

    def serve(self) -> int:
        """Run until stopped; returns the exit status."""
        assert self._control is not None and self._fds is not None and self._guard is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        # A signal writes a byte here, which wakes the poll: pyzmq retries a poll that EINTR cut short
        # for its whole timeout, and an idle loop sleeps for a second.
        self._wake = socket.socketpair()
        for end in self._wake:
            end.setblocking(False)
        previous_wakeup = signal.set_wakeup_fd(self._wake[1].fileno(), warn_on_full_buffer=False)
        self._watch = MemoryWatch(self._guard, self._memory_load, self._ring)
        try:
            return self._loop()
        finally:
            self._watch.close()
            self._watch = None
            signal.set_wakeup_fd(previous_wakeup)
            for end in self._wake:
                end.close()
            self._wake = ()

    def _loop(self) -> int:
        assert self._control is not None and self._fds is not None and self._wake and self._watch is not None
        watch, ledger = self._watch, self.core.ledger
        poller = self._poller()
        mesh_sockets = self._mesh.generation if self._mesh is not None else 0
        self.notifier.ready(self._status())
        now = time.monotonic()
        meshed = self._mesh is not None or self._remote is not None
        tick_every = MESH_TICK_S if meshed else TICK_S
        sweep_longest = MESH_TICK_S if meshed else SWEEP_MAX_S
        sweep_every = sweep_longest
        timers = Timers()
        timers.add("tick", now + tick_every)
        timers.add("sweep", now + sweep_every)
        # The watchdog wakes the loop: an idle loop sleeps a second, and WatchdogSec may ask for pings
        # more often. The rest ride on wake-ups that something else caused.
        wd = self.notifier.watchdog_interval
        if wd:
            timers.add("watchdog", now + wd)
        timers.add("status", now + STATUS_EVERY_S, wakes=False)
        timers.add("trim", now + TRIM_EVERY_S, wakes=False)
        timers.add("settle", math.inf)  # the memory guard's, after a control socket reset
        if self.metrics is not None:
            timers.add("metrics", now, wakes=False)
        while True:
            if self._stop_requests and not self._drain_step():
                break
            if self._reload_requested:
                self._reload_requested = False
                if self._reload is not None:
                    self.notifier.reloading()
                    self._reload()
                    self.notifier.ready(self._status())
            # Rounded up: pyzmq truncates to whole milliseconds, and 0 would spin until the next sweep.
            # Lease expiry, the outbox's flush and the puller's polls keep their own due times.
            wake_at = min(timers.wake_at(), ledger.next_deadline(),
                          time.monotonic() + SWEEP_MIN_S if self._stop_requests else math.inf,
                          self._remote.outbox.next_flush if self._remote is not None else math.inf,
                          self._remote.next_due if self._remote is not None else math.inf,
                          self._puller.next_poll if self._puller is not None else math.inf)
            timeout_ms = max(0, math.ceil((wake_at - time.monotonic()) * 1000))
            events = dict(poller.poll(timeout_ms))  # pyzmq retries EINTR after running signal handlers
            if self._control.router in events:
                self._serve_requests()
            if self._fds.fileno() in events:
                self._fds.on_events()
            if self._feed is not None and self._feed.sock in events:
                self._feed.on_events()
            if self._wake[0].fileno() in events:
                _drain(self._wake[0])
            now = time.monotonic()
            if self._mesh is not None and any(sock in events for sock in self._mesh.sockets()):
                self._mesh.on_events(now)
            if self._remote is not None:
                if self._puller is not None and now >= self._puller.next_poll:
                    self._remote.on_pulled(self._puller.poll(now), now)
                if now >= self._remote.outbox.next_flush:
                    self._remote.outbox.flush(now)
                if now >= self._remote.next_due:
                    self._remote.answer_due(now)
            # No client (not even one handshaking or only on the control socket, whose memory the watch
            # guards) and nothing live.
            idle = len(self._fds) == 0 and self._control.connections == 0 and ledger.live == 0
            if not idle:  # timers an idle loop set far ahead come back in when something arrives
                watch.wake()
                timers.not_after("sweep", now + sweep_every)
                timers.not_after("tick", now + tick_every)
            swept = timers.due("sweep", now)
            if swept:
                sweep_every = sweep_interval(sweep_every, self.core.sweep(now, defer_unacked=True), sweep_longest)
                timers["sweep"] = now + (IDLE_WAKE_S if idle else sweep_every)
            if now >= ledger.next_deadline():  # on time, whatever the tick
                ledger.expire(now)
            if watch.tripped:
                if self._check_memory(now):
                    poller = self._poller()
                    timers["settle"] = self._guard.next_settle
                watch.rearm()
            if timers.due("settle", now):
                self._guard.settle(now)
                timers["settle"] = self._guard.next_settle
            # A tick due before the next sweep runs on this sweep's wake-up, a little early, instead of
            # taking a wake-up of its own: while clients write, every tick rides on a sweep.
            if timers.due("tick", now) or (swept and timers["tick"] < timers["sweep"]):
                self.core.tick(now)
                if self._mesh is not None:
                    self._mesh.tick(now)
                    if self._mesh.generation != mesh_sockets:  # peers came or went: their DEALERs too
                        poller, mesh_sockets = self._poller(), self._mesh.generation
                if self._remote is not None:
                    self._remote.tick(now)
                self._fds.close_stale_handshakes()
                timers["tick"] = now + (IDLE_WAKE_S if idle else tick_every)
            if sweep_every >= tick_every:
                # Nothing written lately: the next sweep rides on the tick's wake-up instead of taking one
                # of its own (a server's idle client otherwise costs twice the wake-ups).
                timers["sweep"] = timers["tick"]
            if timers.due("trim", now):
                malloc_trim()  # what a burst of connections or requests left in the heap goes back
                timers["trim"] = now + TRIM_EVERY_S
            if timers.due("watchdog", now):
                self.notifier.watchdog()
                timers["watchdog"] = now + wd
            if timers.due("status", now):
                self.notifier.status(self._status())
                timers["status"] = now + STATUS_EVERY_S
            if self.metrics is not None and timers.due("metrics", now):
                self.metrics.update(self.core.stats())
                timers["metrics"] = now + METRICS_EVERY_S
        return 0

    def _poller(self) -> zmq.Poller:
        assert self._control is not None and self._fds is not None
        poller = zmq.Poller()
        poller.register(self._control.router, zmq.POLLIN)
        poller.register(self._fds.fileno(), zmq.POLLIN)
        if self._feed is not None and self._feed.sock is not None:
            poller.register(self._feed.sock, zmq.POLLIN)
        if self._wake:
            poller.register(self._wake[0].fileno(), zmq.POLLIN)
        for sock in self._mesh.sockets() if self._mesh is not None else ():
            poller.register(sock, zmq.POLLIN)
        return poller

    def _memory_load(self) -> tuple[int, int]:
        """What the memory guard's budget grows with: connections and live leases (read by its thread)."""
        assert self._control is not None
        feed = self._feed  # read once: this runs on the watch's thread
        return (self._control.connections + len(self._fds or ()) + (feed.connections if feed is not None else 0),
                self.core.ledger.live)

    def _peer_arrived(self) -> None:
        watch = self._watch  # read once: the connection thread calls this while serve() may be ending
        if watch is not None:
            watch.wake()

    def _ring(self) -> None:
        try:
            self._wake[1].send(b"m")
        except OSError:
            pass  # full: the loop has a wake-up pending already

    def _check_memory(self, now: float) -> bool:
        """Reset the control socket (and the key feed) if peers made the daemon outgrow its budget; True if it did."""
        assert self._control is not None and self._guard is not None
        over = self._guard.over(*self._memory_load())
        if over is None:
            return False
        self._control.reset(f"the daemon holds {over >> 20} MiB more than control_memory_mb and its connections allow "
                            "(a peer queued a message that never ends, or requests it never reads the replies to)")
        if self._feed is not None:
            # What a subscriber that never reads left queued for it (up to SEND_HWM messages) goes too.
            self._feed.reset()
        self._guard.reset_at(now)
        return True

    def _drain_step(self) -> bool:
        """Called each loop while a stop is requested: True to keep serving, False to stop now."""
        now = time.monotonic()
        # Features published in arenas count once a sweep adopts them: sweep before counting.
        self.core.sweep(now)
        if self._drain_deadline is None:
            self.core.set_draining()
            self._drain_deadline = now + self.settings.drain_timeout
            log.info(
                "draining: refusing new reserves; %d lease(s) live get up to %.0f s to be acknowledged",
                self.core.ledger.live,
                self.settings.drain_timeout,
            )
            self.notifier.stopping(self._status())
        if self._stop_requests > 1:
            log.info("second stop signal: not waiting for the drain")
            return False
        # Serve (and sweep) a moment whatever is live: a put that read the table's DRAINING flag just
        # before it was set still publishes in its arena, and must not find the daemon gone.
        if now < self._drain_deadline - self.settings.drain_timeout + DRAIN_SETTLE_S:
            return True
        # Retained features nothing holds are a cache, which a drain need not wait out, and a reservation
        # past its reserve_ttl can no longer be published.
        ledger = self.core.ledger
        awaited = ledger.live - ledger.keys.unheld_retained() - ledger.overdue
        return awaited > 0 and now < self._drain_deadline

    def _serve_requests(self) -> None:
        assert self._control is not None and self._control.router is not None
        router = self._control.router
        for _ in range(_MAX_BATCH):
            # Ask before reading: ending each batch on a zmq.Again exception costs more than a request.
            if not router.getsockopt(_EVENTS) & _POLLIN:
                return
            try:
                frames = [router.recv(_NOBLOCK)]
            except zmq.Again:
                return
            while router.getsockopt(_RCVMORE):  # the rest of a message arrives with its first frame
                frames.append(router.recv(_NOBLOCK))
            identity, body = frames[0], frames[1:]
            if len(body) != 1:
                self.core.counters.bad_requests += 1
                reply = error_frame(None, ErrorCode.BAD_REQUEST, f"a request is exactly one frame, got {len(body)}")
            elif len(body[0]) > MAX_REQUEST_BYTES:
                self.core.counters.bad_requests += 1
                reply = error_frame(None, ErrorCode.TOO_LARGE,
                                    f"request of {len(body[0])} B exceeds {MAX_REQUEST_BYTES} B")
            else:
                reply = dispatch(self.core, body[0], send_later=functools.partial(self._send_later, identity))
                if reply is None:
                    continue  # a quiet request that succeeded, or one answered later
            self._reply(router, identity, reply)

    def _send_later(self, identity: bytes, reply: bytes) -> None:
        router = self._control.router if self._control is not None else None
        if router is not None:
            self._reply(router, identity, reply)

    def _reply(self, router: zmq.Socket, identity: bytes, reply: bytes) -> None:
        try:
            router.send(identity, _MORE_NOBLOCK)
            router.send(reply, _NOBLOCK)
        except zmq.Again:
            # Past the peer's mark: it has far more than MAX_IN_FLIGHT requests unanswered, or reads none.
            self.core.counters.replies_dropped += 1
        except zmq.ZMQError:
            pass  # the peer is gone (EHOSTUNREACH); its request died with it

    def _hold(self, name: str, thing: T, close: Callable[[T], object]) -> T:
        """Keep ``thing`` as attribute ``name`` until close(), which closes it and clears the attribute
        (threads that outlive serve() look there: None means gone)."""

        def release() -> None:
            try:
                close(thing)
            finally:
                setattr(self, name, None)

        self._exit.callback(release)
        return thing

    def close(self) -> None:
        """Close what bind() and the constructor took, newest first; each is closed once, even if another
        one's close raised (that error is raised after the rest are closed)."""
        self._exit.close()


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass

