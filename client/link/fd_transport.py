"""Requests on a session's fd channel: quiet sends, calls that wait for their reply, and liveness.

The fd channel is a SOCK_SEQPACKET connection. Its EOF tells the daemon the process is gone; a send on
it is a synchronous write into the daemon's socket buffer, which the daemon reads before that EOF. So a
publish sent there is never lost to a crash right after ``put`` returns, as a ZeroMQ message still in
this process's I/O thread would be, and one process's requests there are handled in the order it sent
them. Quiet requests are answered only when they fail; calls and pings always.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import threading
import time
from typing import Any, Callable, Optional

from mmfeat.protos.codec import decode
from mmfeat.protos.envelope import checked_reply, reply_error, request_frame
from mmfeat.protos.errors import DaemonUnavailableError
from mmfeat.protos.messages import REQUEST_MODELS

from .async_failures import AsyncFailures

_MAX_DATAGRAM = 4096
# Threads share the fd channel: another thread may read our reply (and file it for us) while we sleep in
# poll(), which then sees nothing to read. So a waiter looks again at least this often.
_SHARED_WAIT_S = 0.005
# alive() reads the channel at most this often: a recv per put, get and ack would be the largest cost of
# the shared-memory path. A daemon restart is noticed within it (its descriptors are STALE anyway).
_ALIVE_EVERY_S = 0.001

# This process's pid, kept by a fork hook: alive() runs on every put, get and ack, where a getpid() system
# call each time would be the costliest step of its fast path. Python runs the hook in every forked child.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))

# Called with a success reply to a call nobody waits for any more (it timed out): what it granted must
# be given back, since nobody will use it.
OnUnclaimed = Callable[[dict[str, Any]], None]


class FdTransport:
    """The fd channel of one session. Safe to share between threads."""

    def __init__(self, sock: socket.socket, timeout: float, failures: AsyncFailures) -> None:
        self.timeout = timeout
        self.failures = failures
        self.pid = os.getpid()  # the process that opened it: a forked child must open its own
        self.send_deadlines = False  # set once the daemon's clock is known to be ours
        self.on_unclaimed: Optional[OnUnclaimed] = None
        self._sock = sock
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)
        self._ids = itertools.count(1)
        self._read_lock = threading.Lock()
        self._answered = 0  # the highest ping id the daemon has answered on this channel
        self._waiting: set[int] = set()  # ids of calls waiting for their reply
        self._replies: dict[int, dict[str, Any]] = {}
        self._closed = False
        self._gone = False
        self._next_check = 0.0

    # --- liveness and replies ------------------------------------------------------------------

    def alive(self) -> bool:
        """False once the daemon closed the channel (it exited or restarted). Reads and logs the error
        replies of failed fd-channel requests on the way: they are the only other thing it sends."""
        if self._closed or self._gone or self.pid != _pid[0]:
            return False
        now = time.monotonic()
        if now < self._next_check:
            return True
        if self.pid != os.getpid():
            return False  # a fork that ran no hook (not through Python's os.fork): seen within the interval
        self._next_check = now + _ALIVE_EVERY_S
        with self._read_lock:
            self._gone = not self._drain()
        return not self._gone

    def _drain(self) -> bool:
        # A poll first: an empty channel, the common case, then costs no BlockingIOError (whose strerror
        # lookup was the dearest part of alive()).
        while self._readable.poll(0):
            try:
                data = self._sock.recv(_MAX_DATAGRAM, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            if not data:
                return False
            self._on_reply(data)
        return True

    def _on_reply(self, data: bytes) -> None:
        try:
            reply = decode(data)
        except ValueError as exc:
            self.failures.record("reply", "UNREADABLE", f"a datagram from the daemon on the fd channel: {exc}")
            return
        rid = reply.get("id")
        if isinstance(rid, int) and rid in self._waiting:
            self._replies[rid] = reply
            return
        if reply.get("ok") and isinstance(rid, int):
            self._answered = max(self._answered, rid)
            if self.on_unclaimed is not None:
                self.on_unclaimed(reply)
            return
        # A quiet request's id is its op (send()), so the failure is counted under the op that failed.
        op = rid if isinstance(rid, str) and rid in REQUEST_MODELS else "request"
        self.failures.record(op, *reply_error(reply))

    # --- requests ------------------------------------------------------------------------------

    def send(self, op: str, quiet: bool = True, req_id: Optional[int] = None, **fields: Any) -> None:
        """One request on the fd channel; returns once the daemon's socket buffer holds it."""
        frame = request_frame(op, req_id if req_id is not None else op, fields, quiet=quiet)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._sock.send(frame, socket.MSG_DONTWAIT)
                return
            except (BlockingIOError, InterruptedError):
                pass  # the daemon is behind (or frozen): wait for room, within the timeout
            except OSError as exc:
                raise DaemonUnavailableError(f"fd channel to mmfeatd closed: {exc.strerror}") from None
            left = deadline - time.monotonic()
            if left <= 0 or not _wait(self._sock, select.POLLOUT, left):
                raise DaemonUnavailableError(f"mmfeatd has not read its fd channel for {self.timeout:g} s ({op})")

    def send_frame(self, frame: bytes) -> None:
        """Raw bytes as one datagram on the fd channel (protocol tests); replies are read by sync()."""
        self._sock.send(frame)

    def try_send(self, op: str, **fields: Any) -> bool:
        """A quiet request on the fd channel if the daemon's socket buffer has room now; False if not."""
        frame = request_frame(op, op, fields, quiet=True)
        try:
            self._sock.send(frame, socket.MSG_DONTWAIT)
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise DaemonUnavailableError(f"fd channel to mmfeatd closed: {exc.strerror}") from None

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """A request on the fd channel that waits for its answer. It is ordered after everything this
        process sent there before (a plain ack after its own publish cannot overtake it); raises
        MmfeatError for an error reply and DaemonUnavailableError after the timeout."""
        deadline = time.monotonic() + self.timeout
        if self.send_deadlines:
            fields["deadline"] = deadline  # where this channel's frames carry it: after the op's fields
        n = self.call_later(op, **fields)
        try:
            while True:
                with self._read_lock:
                    alive = self._drain()
                    reply = self._replies.pop(n, None)
                if reply is not None:
                    break
                if not alive:
                    raise DaemonUnavailableError(f"mmfeatd closed the fd channel before answering {op}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonUnavailableError(f"mmfeatd did not answer {op} within {self.timeout:g} s")
                _wait(self._sock, select.POLLIN, min(left, _SHARED_WAIT_S))
        finally:
            with self._read_lock:
                self._waiting.discard(n)
                self._replies.pop(n, None)
        return checked_reply(reply)

    def call_later(self, op: str, **fields: Any) -> int:
        """Send a request that expects an answer without waiting for it; ``reply_to`` reads it later."""
        n = next(self._ids)
        with self._read_lock:
            self._waiting.add(n)
        try:
            self.send(op, quiet=False, req_id=n, **fields)
        except BaseException:
            with self._read_lock:
                self._waiting.discard(n)
            raise
        return n

    def reply_to(self, req_id: int) -> Optional[dict[str, Any]]:
        """The reply to a ``call_later`` request if it has arrived (None if not yet); raises MmfeatError
        for an error reply and DaemonUnavailableError if the daemon closed the channel."""
        with self._read_lock:
            alive = self._drain()
            reply = self._replies.pop(req_id, None)
            if reply is not None or not alive:
                self._waiting.discard(req_id)
        if reply is None:
            if not alive:
                raise DaemonUnavailableError("mmfeatd closed the fd channel before answering")
            return None
        return checked_reply(reply)

    def sync(self, timeout: float) -> bool:
        """Wait until the daemon has handled everything sent on the fd channel so far; False on timeout."""
        n = next(self._ids)
        try:
            self.send("ping", quiet=False, req_id=n)
        except DaemonUnavailableError:
            return False
        deadline = time.monotonic() + timeout
        while True:
            with self._read_lock:
                if not self._drain():
                    return False
                if self._answered >= n:
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _wait(self._sock, select.POLLIN, min(left, _SHARED_WAIT_S))

    def close(self) -> None:
        self._closed = True
        if self.pid == os.getpid():
            # A child forked since holds a copy of this socket: closing ours alone, the daemon would see the
            # session end only once every such child exits. A child's close must not shut its parent's.
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the daemon closed it first
        self._sock.close()


def _wait(sock: socket.socket, event: int, timeout: float) -> bool:
    # poll, not select: select fails outright in a process with more than 1024 fds open.
    poller = select.poll()
    poller.register(sock.fileno(), event)
    return bool(poller.poll(max(0, int(timeout * 1000))))
