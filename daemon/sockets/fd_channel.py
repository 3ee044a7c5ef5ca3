"""The fd channel: an AF_UNIX SOCK_SEQPACKET socket that hands pool fds to clients with SCM_RIGHTS.

ZeroMQ cannot carry fds, and pidfd_getfd needs ptrace rights, so handles go here. A client connects,
sends ``{v, session}`` (msgpack), and gets ``{v, ok, pools, table}`` with one fd per POSIX-fd pool and
then the lease table's fd attached.
The connection then stays open for the life of the client: its EOF is the signal that the process died.
After the handshake the client may send request frames for the ops in FD_CHANNEL_OPS
(publish, bind, ack, release, ping, arena, arena_return).
A send there is a synchronous write into this socket's buffer, and the kernel delivers every datagram
before the EOF, so a publish whose send returned is handled even if its producer dies at once.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import select
import socket
import struct
import termios
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from mmfeat.protos import handshake
from mmfeat.protos.errors import MmfeatError

from ..leases.sessions import PeerCred
from .runtime_dir import SocketFile

log = logging.getLogger("mmfeatd.fds")

_MAX_DATAGRAM = 4096
# Datagrams handled per readable event on one connection, so one busy client cannot starve the rest.
_MAX_BATCH = 64
_HANDSHAKE_TIMEOUT_S = 10.0
# Connections that have not presented a session yet; past this the oldest is dropped.
MAX_PENDING_HANDSHAKES = 256

# authorize(session_token, peer) -> (pool ids, fds to send: one per pool, then the lease table's);
# raises MmfeatError to refuse.
Authorize = Callable[[bytes, PeerCred], tuple[list[int], list[int]]]
OnClose = Callable[[bytes], None]
# on_request(session_token, frame) -> reply frame, or None for a quiet request that succeeded.
OnRequest = Callable[[bytes, bytes], Optional[bytes]]


@dataclass
class _Conn:
    sock: socket.socket
    peer: PeerCred
    opened: float
    session: Optional[bytes] = None


_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+


def peer_creds(sock: socket.socket) -> PeerCred:
    """The peer's pid, uid, gid and supplementary groups, as the kernel recorded them at connect time
    (SO_PEERGROUPS, not /proc/<pid>/status later, where the pid may already be another process's)."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    groups: tuple[int, ...] = ()
    size = 256
    while size <= 1 << 18:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                size *= 4
                continue
            break  # kernel without SO_PEERGROUPS: primary gid only
        groups = struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
        break
    return PeerCred(pid, uid, gid, frozenset(groups) | {gid})


def _peer_gone(sock: socket.socket) -> bool:
    """After recv() returned no bytes: did the peer close, or did it send an empty datagram?"""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))


class FdChannel:
    """The listener and every connection, watched by one epoll set whose fd the server loop polls, so a
    loop iteration costs the same with three thousand idle clients as with three."""

    def __init__(
        self, path: Path, mode: int, authorize: Authorize, on_close: OnClose, on_request: OnRequest, max_clients: int
    ) -> None:
        self.path = path
        self._authorize = authorize
        self._on_close = on_close
        self._on_request = on_request
        self.max_clients = max_clients
        # No handshake yet, oldest first; ordered because a flood of silent connections drops its oldest
        # again and again, and a plain dict's oldest lies behind every key deleted from its front.
        self._pending: OrderedDict[int, _Conn] = OrderedDict()
        self._attached: dict[int, _Conn] = {}
        self.refused = 0
        self.handshakes_refused = 0
        self._last_warning = float("-inf")
        self._file = SocketFile(path, socket.SOCK_SEQPACKET, mode)
        self.listener = self._file.sock
        self.listener.setblocking(False)
        self._epoll = select.epoll()
        self._epoll.register(self.listener.fileno(), select.EPOLLIN)

    def fileno(self) -> int:
        """The epoll fd: readable when the listener or any connection is."""
        return self._epoll.fileno()

    def owns(self, fd: int) -> bool:
        return fd in self._pending or fd in self._attached or fd in (self.listener.fileno(), self._epoll.fileno())

    def __len__(self) -> int:
        return len(self._pending) + len(self._attached)

    def on_events(self) -> None:
        for fd, _ in self._epoll.poll(0, 256):
            if fd == self.listener.fileno():
                self._accept()
            else:
                self.on_readable(fd)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of fds (EMFILE/ENFILE), most likely from connections that never handshake: drop
                # the oldest of those so the clients that do handshake can still get in.
                self._warn(f"fd channel accept failed ({exc.strerror}); dropping unauthenticated connections")
                self._drop_oldest_pending(max(1, len(self._pending) // 4))
                return
            if len(self._attached) >= self.max_clients:
                self.refused += 1
                self._warn(f"fd channel: {len(self._attached)} clients attached, the max_clients limit; "
                           "refused a new one "
                           f"({self.refused} so far)")
                sock.close()
                continue
            if len(self._pending) >= min(MAX_PENDING_HANDSHAKES, max(8, self.max_clients)):
                self._drop_oldest_pending(1)  # each costs an fd: at most as many as clients may attach
            sock.setblocking(False)
            self._pending[sock.fileno()] = _Conn(sock, peer_creds(sock), time.monotonic())
            self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _warn(self, message: str) -> None:
        # At most one line per 10 s: a peer must not be able to flood the log (or block a daemon whose
        # stderr is a pipe nobody drains).
        now = time.monotonic()
        if now - self._last_warning > 10:
            self._last_warning = now
            log.warning("%s", message)

    def read_waiting(self) -> None:
        """Handle every request already queued on the attached connections: all that their peers sent
        before this call, and no more, whatever they send meanwhile (SIOCINQ of a SOCK_SEQPACKET socket
        counts the bytes of every queued datagram). A control request calls it where its answer must
        reflect what a client sent here before it (a lookup by key after a producer's bind)."""
        for fileno, _ in self._epoll.poll(0, len(self) + 2):
            conn = self._attached.get(fileno)
            if conn is not None:
                try:
                    queued = struct.unpack("i", fcntl.ioctl(fileno, termios.FIONREAD, b"\0" * 4))[0]
                except OSError:
                    queued = _MAX_BATCH * _MAX_DATAGRAM
                self.on_readable(fileno, queued)

    def on_readable(self, fileno: int, queued: Optional[int] = None) -> None:
        """Handle up to _MAX_BATCH datagrams of a readable connection; with ``queued``, datagrams until
        that many bytes are read instead (an empty one counts as a byte)."""
        conn = self._attached.get(fileno) or self._pending.get(fileno)
        if conn is None:
            return
        left = _MAX_BATCH if queued is None else queued
        while left > 0:
            try:
                data = conn.sock.recv(_MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(fileno)  # reset by the peer
                return
            if not data and _peer_gone(conn.sock):
                # EOF: the process exited or crashed, after everything it sent was read.
                self._drop(fileno)
                return
            left -= 1 if queued is None else max(1, len(data))
            if conn.session is None:
                self._handshake(fileno, conn, data)
                return
            reply = self._on_request(conn.session, data)
            if reply is not None:
                try:
                    conn.sock.send(reply, socket.MSG_DONTWAIT)
                except OSError:
                    pass  # a client that does not read its replies loses them, not the daemon's time

    def _handshake(self, fileno: int, conn: _Conn, data: bytes) -> None:
        try:
            token = handshake.parse_hello(data)
            pool_ids, fds = self._authorize(token, conn.peer)
            if not handshake.wants_pools(data):
                pool_ids, fds = [], fds[-1:]  # a control-only client: the lease table's fd alone
        except MmfeatError as exc:
            self.handshakes_refused += 1
            self._warn(f"refused an fd channel from pid {conn.peer.pid} uid {conn.peer.uid}: {exc} "
                       f"({self.handshakes_refused} handshakes refused so far)")
            self._send(conn, handshake.refused(exc), [])
            self._drop(fileno, notify=False)
            return
        conn.session = token
        self._attached[fileno] = self._pending.pop(fileno)
        if not self._send(conn, handshake.accepted(pool_ids), fds):
            self._drop(fileno)

    def _send(self, conn: _Conn, reply: bytes, fds: list[int]) -> bool:
        try:
            socket.send_fds(conn.sock, [reply], fds)
            return True
        except OSError as exc:
            log.debug("fd channel send to pid %d failed: %s", conn.peer.pid, exc)
            return False

    def _drop_oldest_pending(self, n: int) -> None:
        for _ in range(min(n, len(self._pending))):
            self._drop(next(iter(self._pending)), notify=False)

    def close_stale_handshakes(self) -> None:
        cutoff = time.monotonic() - _HANDSHAKE_TIMEOUT_S
        while self._pending:
            fileno, conn = next(iter(self._pending.items()))
            if conn.opened >= cutoff:
                break
            self._drop(fileno, notify=False)

    def _drop(self, fileno: int, notify: bool = True) -> None:
        conn = self._pending.pop(fileno, None) or self._attached.pop(fileno, None)
        if conn is None:
            return
        self._epoll.unregister(fileno)
        conn.sock.close()
        if notify and conn.session is not None:
            self._on_close(conn.session)

    def drop_session(self, token: bytes) -> None:
        """Close the fd channel of session ``token`` (the daemon ended the session itself)."""
        for fileno, conn in list(self._attached.items()):
            if conn.session == token:
                self._drop(fileno, notify=False)

    def close(self) -> None:
        for fileno in [*self._pending, *self._attached]:
            self._drop(fileno, notify=False)
        self._epoll.close()
        self.listener.close()
        self._file.unlink()
