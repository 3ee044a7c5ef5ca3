"""The control loop: a ZMQ ROUTER for requests, the fd channel for handles, a tick for expiry, signals."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Optional

import zmq

from mmfeat.protos.codec import MAX_REQUEST_BYTES
from mmfeat.protos.errors import ErrorCode
from mmfeat.protos.paths import CONTROL_SOCKET, control_endpoint, fd_socket_path

from .core import DaemonCore
from .dispatch import _error, dispatch
from .fd_channel import FdChannel

log = logging.getLogger("mmfeatd")

TICK_S = 0.1
# Frames between MAX_REQUEST_BYTES and this get a TOO_LARGE reply; beyond it ZMQ drops the peer.
_HARD_FRAME_LIMIT = 1 << 20
_MAX_BATCH = 256


class Server:
    def __init__(self, core: DaemonCore) -> None:
        self.core = core
        self.settings = core.settings
        self._stop = False
        self._ctx: Optional[zmq.Context] = None
        self._router: Optional[zmq.Socket] = None
        self._fds: Optional[FdChannel] = None
        self._registered: set[int] = set()

    def request_stop(self, signum: int = 0, frame: object = None) -> None:
        self._stop = True

    def bind(self) -> None:
        runtime = self.settings.runtime_dir
        self._ctx = zmq.Context()
        router = self._ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.maxmsgsize = _HARD_FRAME_LIMIT
        router.sndhwm = router.rcvhwm = 10000
        endpoint = control_endpoint(runtime)
        sock_path = runtime / CONTROL_SOCKET
        if sock_path.exists():
            sock_path.unlink()  # main() checked that no live daemon owns it
        router.bind(endpoint)
        os.chmod(sock_path, self.settings.socket_mode)
        self._router = router
        self.core.endpoint = endpoint
        self._fds = FdChannel(fd_socket_path(runtime), self.settings.socket_mode, self.core.authorize_fds, self._on_fd_close)

    def _on_fd_close(self, token: bytes) -> None:
        n = self.core.end_session(token)
        if n:
            log.info("a client disconnected with %d unpublished lease(s); reclaimed", n)

    def serve(self) -> int:
        """Run until SIGTERM/SIGINT; returns the exit status."""
        assert self._router is not None and self._fds is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._fds.listener, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        while not self._stop:
            self._sync_registrations(poller)
            timeout_ms = max(0.0, (next_tick - time.monotonic()) * 1000)
            events = dict(poller.poll(timeout_ms))  # pyzmq retries EINTR after running signal handlers
            if self._router in events:
                self._serve_requests()
            for key in events:
                if key is self._router:
                    continue
                if key is self._fds.listener or key == self._fds.listener.fileno():
                    self._fds.accept()
                else:
                    self._fds.on_readable(key if isinstance(key, int) else key.fileno())
            now = time.monotonic()
            if now >= next_tick:
                self.core.tick(now)
                self._fds.close_stale_handshakes()
                next_tick = now + TICK_S
        return 0

    def _sync_registrations(self, poller: zmq.Poller) -> None:
        assert self._fds is not None
        live = {s.fileno(): s for s in self._fds.connections()}
        for fileno in self._registered - live.keys():
            try:
                poller.unregister(fileno)
            except KeyError:
                pass
        for fileno in live.keys() - self._registered:
            poller.register(fileno, zmq.POLLIN)
        self._registered = set(live)

    def _serve_requests(self) -> None:
        assert self._router is not None
        for _ in range(_MAX_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            if len(body) != 1:
                self.core.counters.bad_requests += 1
                reply = _error(None, ErrorCode.BAD_REQUEST, f"a request is exactly one frame, got {len(body)}")
            elif len(body[0]) > MAX_REQUEST_BYTES:
                self.core.counters.bad_requests += 1
                reply = _error(None, ErrorCode.TOO_LARGE, f"request of {len(body[0])} B exceeds {MAX_REQUEST_BYTES} B")
            else:
                reply = dispatch(self.core, body[0])
            try:
                self._router.send_multipart([identity, reply], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the peer is gone or not reading; its request died with it

    def close(self) -> None:
        if self._fds is not None:
            self._fds.close()
            self._fds = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
            try:
                (self.settings.runtime_dir / CONTROL_SOCKET).unlink()
            except FileNotFoundError:
                pass
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
