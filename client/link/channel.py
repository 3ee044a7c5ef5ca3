"""The control channel: a ZMQ DEALER that sends one request and waits, with a deadline, for its reply.

A request the client stopped waiting for must not take effect behind its back. Calls carry their
deadline (once the daemon's clock is known to be ours), and the daemon drops a request that arrives
after it. A reply that still comes late (the daemon acted just before the deadline) is read later:
a late successful reserve is released at once, so the lease it made holds no memory.

A connection has at most MAX_IN_FLIGHT requests in flight (SPEC.md, section 2), within which the daemon
drops no reply: calls wait for each other, a hint that would pass it is not sent, a quiet request waits
for a ping's reply first, and calls that timed out and fill it are given up with their connection.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import zmq

from mmfeat.protos.codec import MAX_IN_FLIGHT, decode
from mmfeat.protos.envelope import checked_reply, reply_error, request_frame
from mmfeat.protos.errors import DaemonUnavailableError, MmfeatError
from mmfeat.protos.messages import REQUEST_MODELS, LeaseReply

from . import fd_budget
from .async_failures import AsyncFailures
from .daemon_lock import gone_daemon
from .in_flight import InFlight, deferred_until

log = logging.getLogger("mmfeat.client")

_MAX_ABANDONED = 256
# A quiet request sent from here carries its op's name as its id, so that its error reply says which op
# failed; a prefetch hint's id is "hint", which names no op: it is dropped when it fails.
# A call unanswered this long asks the runtime dir's lock whether a daemon is there at all, so a dead
# one costs this instead of the whole timeout. A live daemon answers most calls well within it.
_GONE_CHECK_MS = 100
# The process whose ZeroMQ context has started its threads (their fds are then taken).
_context_started_pid: Optional[int] = None


# Every channel of this process: a forked child takes their locks fresh. A thread of the parent that waits
# in a call at the fork holds its channel's lock in the child for good, where no thread will release it,
# and the child's first call on that channel would wait forever.
_channels: "weakref.WeakSet[ControlChannel]" = weakref.WeakSet()


def _unlock_in_child() -> None:
    for channel in list(_channels):
        channel._lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


class ControlChannel:
    """Request/reply over DEALER with id matching, so a reply that arrives after its timeout is dropped
    instead of being mistaken for the next one. Safe to share between threads."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._sock: Optional[zmq.Socket] = None
        self._pid = os.getpid()
        # Where the daemon's lock is, for an ipc endpoint; None when there is nothing to ask.
        self._runtime_dir = Path(endpoint[6:]).parent if endpoint.startswith("ipc://") else None
        # Calls that timed out, by id, so their late replies can be undone (bounded: the oldest go first).
        # Ordered for O(1) eviction of the oldest (see AckRoutes._unconfirmed).
        self._abandoned: OrderedDict[int, tuple[str, dict[str, Any]]] = OrderedDict()
        # Failed requests nobody waits for, here and on the session's fd channel.
        self.failures = AsyncFailures()
        # Set once hello showed that the daemon's CLOCK_MONOTONIC is this process's.
        self.send_deadlines = False
        self._in_flight = InFlight(MAX_IN_FLIGHT)
        _channels.add(self)

    def _socket(self) -> zmq.Socket:
        if self._sock is not None and self._pid != os.getpid():
            self._sock = None  # inherited across fork: never touch the parent's socket
        if self._sock is None:
            if self.endpoint.startswith("ipc://") and not os.path.exists(self.endpoint[6:]):
                raise DaemonUnavailableError(
                    f"no mmfeatd socket at {self.endpoint[6:]}: start mmfeatd or set MMFEAT_RUNTIME_DIR"
                )
            if self._runtime_dir is not None:
                # The lock alone: a live daemon should not see a probe's connection from every new socket.
                gone = gone_daemon(self._runtime_dir, ask_socket=False)
                if gone is not None:
                    raise DaemonUnavailableError(gone)
            self._sock, self._pid = _open_dealer(self.endpoint, self.timeout), os.getpid()
            self._in_flight.clear()  # a fresh connection: nothing is in flight on it
        return self._sock

    def call(self, op: str, timeout: Optional[float] = None, **fields: Any) -> dict[str, Any]:
        """Send ``op`` and return the reply body; raise MmfeatError for an error reply and
        DaemonUnavailableError when no reply comes within ``timeout`` seconds."""
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            return self._call(op, timeout, fields)

    def _call(self, op: str, timeout: float, fields: dict[str, Any]) -> dict[str, Any]:
        # Called with the lock held.
        if self._sock is not None and not self._in_flight.room():
            # Only calls that timed out can fill it (the rest leave room for a call): their replies are
            # not coming, or not soon. A fresh connection drops them; a late reserve's range stays the session's.
            log.info("%d requests to mmfeatd unanswered; opening a fresh connection", self._in_flight.count())
            self._reset()
        sock = self._socket()
        req_id = next(self._ids)
        deadline = time.monotonic() + timeout
        frame = request_frame(op, req_id, fields, deadline=deadline if self.send_deadlines else None)
        try:
            sock.send(frame)
        except zmq.Again:
            raise DaemonUnavailableError(f"mmfeatd at {self.endpoint} is not accepting requests ({op})") from None
        self._in_flight.sent(req_id, deferred_until(op, fields, deadline, timeout))
        asked_lock = self._runtime_dir is None
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                # Keep the socket: its late reply is read (and undone, for a reserve) later.
                self._abandon(req_id, op, fields)
                raise DaemonUnavailableError(f"mmfeatd at {self.endpoint} did not answer {op} within {timeout:g} s")
            if not sock.poll(left_ms if asked_lock else min(left_ms, _GONE_CHECK_MS)):
                if not asked_lock:
                    asked_lock = True
                    gone = gone_daemon(self._runtime_dir)  # type: ignore[arg-type]
                    if gone is not None:
                        self._abandon(req_id, op, fields)
                        raise DaemonUnavailableError(gone)
                continue
            reply = decode(sock.recv())
            rid = reply.get("id")
            if isinstance(rid, int):
                self._in_flight.answered(rid)
            if rid == req_id:
                break
            self._stray(reply)
        return checked_reply(reply)

    def send(self, op: str, **fields: Any) -> None:
        """``op`` as a quiet request: answered only if it fails, and that failure is counted in
        ``failures`` under ``op`` once a later call reads it."""
        frame = request_frame(op, op, fields, quiet=True)
        with self._lock:
            if not self._in_flight.room(2):  # leave room for a call
                self._call("ping", self.timeout, {})  # its reply settles every quiet request before it
            try:
                self._socket().send(frame)
            except zmq.Again:
                raise DaemonUnavailableError(f"mmfeatd at {self.endpoint} is not accepting requests ({op})") from None
            self._in_flight.sent()

    def hint(self, op: str, **fields: Any) -> None:
        """``op`` as a quiet request nobody waits for: its error reply, if any, carries the id "hint" and
        is dropped unread. Never blocks: a hint the socket cannot take now is dropped too."""
        frame = request_frame(op, "hint", fields, quiet=True)
        with self._lock:
            if not self._in_flight.room(2):  # leave room for a call; a hint is never worth a wait
                return
            try:
                self._socket().send(frame, zmq.NOBLOCK)
            except (zmq.ZMQError, MmfeatError):
                return
            self._in_flight.sent()

    def send_frame(self, frame: bytes) -> None:
        """One raw request frame on this channel's socket, without waiting (tools, protocol tests)."""
        with self._lock:
            self._socket().send(frame)

    def receive_frame(self, timeout: float) -> Optional[bytes]:
        """The next frame this channel's socket receives within ``timeout`` seconds, or None."""
        with self._lock:
            sock = self._socket()
            return sock.recv() if sock.poll(int(timeout * 1000)) else None

    def _abandon(self, req_id: int, op: str, fields: dict[str, Any]) -> None:
        self._abandoned[req_id] = (op, fields)
        while len(self._abandoned) > _MAX_ABANDONED:
            self._abandoned.popitem(last=False)

    def _stray(self, reply: dict[str, Any]) -> None:
        # A late reply to a call that already timed out, or the error reply to a quiet release sent from
        # here. Called with the lock held.
        rid = reply.get("id")
        if not reply.get("ok") and isinstance(rid, str) and rid in REQUEST_MODELS:
            self.failures.record(rid, *reply_error(reply))
        abandoned = self._abandoned.pop(rid, None) if isinstance(rid, int) else None
        if abandoned is not None and abandoned[0] == "reserve" and reply.get("ok"):
            # The caller fell back inline long ago; nobody will publish this lease.
            try:
                lease = LeaseReply.from_wire(reply).lease
            except MmfeatError as exc:
                self.failures.record("reserve", exc.code.value, exc.message)
                return  # names no lease to release: the session's end frees it
            log.info("releasing lease %s, reserved after its request had timed out", lease.lease)
            if not self._in_flight.room():
                return  # the session's end frees it
            try:
                fields = {"session": abandoned[1].get("session"), "lease": lease.to_wire()}
                self._socket().send(request_frame("release", "release", fields, quiet=True), zmq.NOBLOCK)
            except (zmq.ZMQError, DaemonUnavailableError):
                return  # the session's end frees it
            self._in_flight.sent()

    def _reset(self) -> None:
        # After a timeout the socket may hold a half-finished exchange; a fresh one is cheaper to reason about.
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._in_flight.clear()

    def close(self) -> None:
        with self._lock:
            self._reset()


def _open_dealer(endpoint: str, timeout: float) -> zmq.Socket:
    """A DEALER connected to ``endpoint``, or FdLimitError when this process cannot spare its fds. The
    count comes first: libzmq aborts the process when a context's thread cannot get its epoll fd."""
    global _context_started_pid
    started = _context_started_pid == os.getpid()
    needed = fd_budget.ZMQ_SOCKET_FDS + (0 if started else fd_budget.ZMQ_CONTEXT_FDS)
    fd_budget.ensure(needed, "a control socket to mmfeatd")
    try:
        sock = zmq.Context.instance().socket(zmq.DEALER)
    except zmq.ZMQError as exc:
        if fd_budget.is_exhaustion(exc):
            raise fd_budget.exhausted(exc, "a control socket to mmfeatd") from None
        raise
    _context_started_pid = os.getpid()
    try:
        sock.linger = 0
        # Not ZMQ_IMMEDIATE: with it, a reply still unread when the daemon closes the connection is
        # dropped (the ack that ends a drain would time out). A call still queued for an absent
        # daemon reaches its successor past its deadline and is dropped there (TIMED_OUT).
        sock.sndtimeo = int(timeout * 1000)
        sock.connect(endpoint)
    except BaseException as exc:
        sock.close(linger=0)
        if isinstance(exc, zmq.ZMQError) and fd_budget.is_exhaustion(exc):
            raise fd_budget.exhausted(exc, "a control socket to mmfeatd") from None
        raise
    return sock
