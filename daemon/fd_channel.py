"""The fd channel: an AF_UNIX SOCK_SEQPACKET socket that hands pool fds to clients with SCM_RIGHTS.

ZeroMQ cannot carry fds, and pidfd_getfd needs ptrace rights, so handles go here. A client connects,
sends ``{v, session}`` (msgpack), and gets ``{v, ok, pools, table}`` with one fd per POSIX-fd pool and
then the lease table's fd attached.
The connection then stays open for the life of the client: its EOF is the signal that the process died.
After the handshake the client may send request frames for the ops in FD_CHANNEL_OPS (publish, ping).
A send there is a synchronous write into this socket's buffer, and the kernel delivers every datagram
before the EOF, so a publish whose send returned is handled even if its producer dies at once.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import msgpack

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.version import PROTOCOL_VERSION

from .runtime_dir import SocketFile
from .sessions import PeerCred

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


def peer_groups(pid: int) -> set[int]:
    """Primary and supplementary gids of a live process (SO_PEERCRED gives only the primary one)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


class FdChannel:
    def __init__(self, path: Path, mode: int, authorize: Authorize, on_close: OnClose, on_request: OnRequest) -> None:
        self.path = path
        self._authorize = authorize
        self._on_close = on_close
        self._on_request = on_request
        self._conns: dict[int, _Conn] = {}
        self._last_accept_warning = 0.0
        self._file = SocketFile(path, socket.SOCK_SEQPACKET, mode)
        self.listener = self._file.sock
        self.listener.setblocking(False)

    def connections(self) -> list[socket.socket]:
        return [c.sock for c in self._conns.values()]

    def accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            # Out of fds (EMFILE/ENFILE), most likely from connections that never handshake: drop the
            # oldest of those so the clients that do handshake can still get in.
            now = time.monotonic()
            if now - self._last_accept_warning > 10:
                self._last_accept_warning = now
                log.warning("fd channel accept failed (%s); dropping unauthenticated connections", exc.strerror)
            self._drop_oldest_pending(max(1, len(self._conns) // 4))
            return
        sock.setblocking(False)
        if self._pending() >= MAX_PENDING_HANDSHAKES:
            self._drop_oldest_pending(1)
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        self._conns[sock.fileno()] = _Conn(sock, PeerCred(pid, uid, gid), time.monotonic())

    def on_readable(self, fileno: int) -> None:
        conn = self._conns.get(fileno)
        if conn is None:
            return
        for _ in range(_MAX_BATCH):
            try:
                data = conn.sock.recv(_MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:  # EOF: the process exited or crashed, after everything it sent was read
                self._drop(fileno)
                return
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
            try:
                msg = msgpack.unpackb(data, raw=False, max_ext_len=0)
            except Exception:
                raise MmfeatError(ErrorCode.BAD_REQUEST, "fd channel hello is not msgpack") from None
            if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION:
                raise MmfeatError(ErrorCode.UNSUPPORTED_VERSION, f"fd channel speaks version {PROTOCOL_VERSION}")
            token = msg.get("session")
            if not isinstance(token, bytes):
                raise MmfeatError(ErrorCode.BAD_REQUEST, "fd channel hello needs 'session' (bytes from the hello reply)")
            pool_ids, fds = self._authorize(token, conn.peer)
        except MmfeatError as exc:
            log.info("refused fd channel from pid %d uid %d: %s", conn.peer.pid, conn.peer.uid, exc)
            self._send(conn, {"v": PROTOCOL_VERSION, "ok": False, "error": exc.to_wire()}, [])
            self._drop(fileno, notify=False)
            return
        conn.session = token
        if not self._send(conn, {"v": PROTOCOL_VERSION, "ok": True, "pools": pool_ids, "table": True}, fds):
            self._drop(fileno)

    def _send(self, conn: _Conn, reply: dict, fds: list[int]) -> bool:
        try:
            socket.send_fds(conn.sock, [msgpack.packb(reply, use_bin_type=True)], fds)
            return True
        except OSError as exc:
            log.info("fd channel send to pid %d failed: %s", conn.peer.pid, exc)
            return False

    def _pending(self) -> int:
        return sum(1 for c in self._conns.values() if c.session is None)

    def _drop_oldest_pending(self, n: int) -> None:
        pending = sorted((c.opened, fileno) for fileno, c in self._conns.items() if c.session is None)
        for _, fileno in pending[:n]:
            self._drop(fileno, notify=False)

    def close_stale_handshakes(self) -> None:
        cutoff = time.monotonic() - _HANDSHAKE_TIMEOUT_S
        for fileno, conn in list(self._conns.items()):
            if conn.session is None and conn.opened < cutoff:
                self._drop(fileno, notify=False)

    def _drop(self, fileno: int, notify: bool = True) -> None:
        conn = self._conns.pop(fileno, None)
        if conn is None:
            return
        conn.sock.close()
        if notify and conn.session is not None:
            self._on_close(conn.session)

    def close(self) -> None:
        for fileno in list(self._conns):
            self._drop(fileno, notify=False)
        self.listener.close()
        self._file.unlink()
