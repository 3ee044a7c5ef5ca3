"""Client side of the fd channel: present the session token, receive one fd per POSIX-fd pool."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgpack

from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.version import PROTOCOL_VERSION

_MAX_FDS = 64


def open_fd_channel(path: Path, session: bytes, timeout: float) -> tuple[socket.socket, dict[int, int], int]:
    """Connect, authenticate, receive fds. Returns the open socket (keep it: closing it tells the daemon
    this client is gone), ``{pool_id: fd}`` and the lease table's fd; the caller owns the fds."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    fds: list[int] = []
    try:
        try:
            sock.connect(str(path))
            sock.sendall(msgpack.packb({"v": PROTOCOL_VERSION, "session": session}, use_bin_type=True))
            data, fds, flags, _ = socket.recv_fds(sock, 4096, _MAX_FDS)
        except (socket.timeout, ConnectionError, FileNotFoundError) as exc:
            raise DaemonUnavailableError(f"fd channel {path}: {exc}") from None
        if flags & socket.MSG_CTRUNC:
            raise MmfeatError(ErrorCode.INTERNAL, "pool fds were truncated in transit: raise this process's fd limit (ulimit -n)")
        if not data:
            raise DaemonUnavailableError(f"fd channel {path} closed during the handshake")
        reply = msgpack.unpackb(data, raw=False)
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise MmfeatError(ErrorCode(err.get("code", "INTERNAL")), err.get("message", "refused"))
        pools = reply.get("pools", [])
        if not reply.get("table") or len(pools) + 1 != len(fds):
            raise MmfeatError(ErrorCode.INTERNAL, f"daemon named {len(pools)} pools and a table but sent {len(fds)} fds")
        sock.settimeout(None)
        received = dict(zip(pools, fds))
        table_fd = fds[-1]
        fds = []
        return sock, received, table_fd
    except BaseException:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise
