"""The control loop: a ZMQ ROUTER for requests, the fd channel for handles, a tick for expiry, signals.

SIGTERM/SIGINT drain (no new reserves; published leases get ``drain_timeout`` seconds to be acked),
a second one stops at once. SIGHUP reloads what can change without a restart.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from typing import Callable, Optional

import zmq

from mmfeat.protos.codec import MAX_REQUEST_BYTES
from mmfeat.protos.errors import ErrorCode
from mmfeat.protos.paths import CONTROL_SOCKET, control_endpoint, fd_socket_path

from .config import Settings
from .core import DaemonCore
from .dispatch import dispatch, error_reply
from .fd_channel import FdChannel
from .metrics import Metrics
from .runtime_dir import SocketFile
from .sd_notify import Notifier

log = logging.getLogger("mmfeatd")

TICK_S = 0.1
STATUS_EVERY_S = 5.0
METRICS_EVERY_S = 0.5
# Frames between MAX_REQUEST_BYTES and this get a TOO_LARGE reply; beyond it ZMQ drops the peer.
_HARD_FRAME_LIMIT = 1 << 20
_MAX_BATCH = 256
# Plain ints: pyzmq's flag enums cost a few microseconds per operation on the per-request path.
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
# Replies queued in ZMQ's I/O thread when the loop ends (the ack that finished a drain) still go out.
_REPLY_LINGER_MS = 500

Reload = Callable[[], None]


class Server:
    def __init__(
        self,
        core: DaemonCore,
        notifier: Optional[Notifier] = None,
        metrics: Optional[Metrics] = None,
        reload: Optional[Reload] = None,
    ) -> None:
        self.core = core
        self.notifier = notifier or Notifier({})
        self.metrics = metrics
        self._reload = reload
        self._stop_requests = 0
        self._reload_requested = False
        self._drain_deadline: Optional[float] = None
        self._ctx: Optional[zmq.Context] = None
        self._router: Optional[zmq.Socket] = None
        self._fds: Optional[FdChannel] = None
        self._control_file: Optional[SocketFile] = None
        self._registered: set[int] = set()

    @property
    def settings(self) -> Settings:  # reload replaces core.settings; always read the current one
        return self.core.settings

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._stop_requests += 1

    def _on_hup(self, signum: int, frame: object) -> None:
        self._reload_requested = True

    def bind(self) -> None:
        runtime = self.settings.runtime_dir
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.maxmsgsize = _HARD_FRAME_LIMIT
        router.sndhwm = router.rcvhwm = 10000
        endpoint = control_endpoint(runtime)
        # Our own listening socket, handed to ZeroMQ: made with the right mode, and libzmq will not
        # unlink the file at close (we do, only if it is still ours).
        self._control_file = SocketFile(runtime / CONTROL_SOCKET, socket.SOCK_STREAM, self.settings.socket_mode)
        router.setsockopt(zmq.USE_FD, self._control_file.sock.detach())
        router.bind(endpoint)
        self._router = router
        self.core.endpoint = endpoint
        self._fds = FdChannel(
            fd_socket_path(runtime), self.settings.socket_mode, self.core.authorize_fds, self._on_fd_close,
            lambda session, frame: dispatch(self.core, frame, session=session),
        )

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
        assert self._router is not None and self._fds is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._fds.listener, zmq.POLLIN)
        self.notifier.ready(self._status())
        now = time.monotonic()
        next_tick = now + TICK_S
        next_status = now + STATUS_EVERY_S
        next_metrics = now
        wd = self.notifier.watchdog_interval
        next_watchdog = now + wd if wd else None
        while True:
            if self._stop_requests and not self._drain_step():
                break
            if self._reload_requested:
                self._reload_requested = False
                if self._reload is not None:
                    self.notifier.reloading()
                    self._reload()
                    self.notifier.ready(self._status())
            self._sync_registrations(poller)
            timeout_ms = max(0.0, (next_tick - time.monotonic()) * 1000)
            events = dict(poller.poll(timeout_ms))  # pyzmq retries EINTR after running signal handlers
            if self._router in events:
                self._serve_requests()
            for key in events:
                if key is self._router:
                    continue
                # pyzmq may hand a plain socket back as the object or as its fileno.
                fileno = key if isinstance(key, int) else key.fileno()
                if fileno == self._fds.listener.fileno():
                    self._fds.accept()
                else:
                    self._fds.on_readable(fileno)
            now = time.monotonic()
            if now >= next_tick:
                self.core.tick(now)
                self._fds.close_stale_handshakes()
                next_tick = now + TICK_S
            if next_watchdog is not None and now >= next_watchdog:
                self.notifier.watchdog()
                next_watchdog = now + (wd or 1.0)
            if now >= next_status:
                self.notifier.status(self._status())
                next_status = now + STATUS_EVERY_S
            if self.metrics is not None and now >= next_metrics:
                self.metrics.update(self.core.stats())
                next_metrics = now + METRICS_EVERY_S
        return 0

    def _drain_step(self) -> bool:
        """Called each loop while a stop is requested: True to keep serving, False to stop now."""
        now = time.monotonic()
        if self._drain_deadline is None:
            self.core.draining = True
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
        return self.core.ledger.live > 0 and now < self._drain_deadline

    def _sync_registrations(self, poller: zmq.Poller) -> None:
        assert self._fds is not None
        live = {s.fileno() for s in self._fds.connections()}
        if live == self._registered:
            return
        for fileno in self._registered - live:
            try:
                poller.unregister(fileno)
            except KeyError:
                pass
        for fileno in live - self._registered:
            poller.register(fileno, zmq.POLLIN)
        self._registered = live

    def _serve_requests(self) -> None:
        assert self._router is not None
        router = self._router
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
                reply = error_reply(None, ErrorCode.BAD_REQUEST, f"a request is exactly one frame, got {len(body)}")
            elif len(body[0]) > MAX_REQUEST_BYTES:
                self.core.counters.bad_requests += 1
                reply = error_reply(None, ErrorCode.TOO_LARGE, f"request of {len(body[0])} B exceeds {MAX_REQUEST_BYTES} B")
            else:
                reply = dispatch(self.core, body[0])
                if reply is None:
                    continue  # a quiet request that succeeded
            try:
                router.send(identity, _MORE_NOBLOCK)
                router.send(reply, _NOBLOCK)
            except zmq.ZMQError:
                pass  # the peer is gone or not reading; its request died with it

    def close(self) -> None:
        if self._fds is not None:
            self._fds.close()
            self._fds = None
        if self._router is not None:
            self._router.close(linger=_REPLY_LINGER_MS)
            self._router = None
        if self._control_file is not None:
            self._control_file.unlink()
            self._control_file = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.notifier.close()
