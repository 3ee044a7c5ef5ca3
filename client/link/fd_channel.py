"""Client side of the fd channel: check who serves it, present the session token, receive the fds.

Before anything is sent, the daemon's credentials (SO_PEERCRED) must name a uid this process can
trust: its own, root, or the owner of the runtime directory when that directory sits where other
users cannot create entries. A directory squatted in /tmp by another user, or one that others may
write, is refused, so a fake daemon never receives a session or serves a pool.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path

from mmfeat.protos import handshake
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, FdLimitError, MmfeatError

_MAX_FDS = 64


def trusted_daemon_uids(runtime_dir: Path) -> set[int]:
    """The uids a daemon serving ``runtime_dir`` may run as; FORBIDDEN when the directory is unsafe."""
    try:
        st, parent = os.stat(runtime_dir), os.stat(runtime_dir.parent)
    except OSError as exc:
        raise DaemonUnavailableError(f"runtime dir {runtime_dir}: {exc.strerror}") from None
    if st.st_mode & stat.S_IWOTH:
        raise MmfeatError(
            ErrorCode.FORBIDDEN,
            f"runtime dir {runtime_dir} is writable by every user, so its sockets cannot be trusted; chmod o-w it",
        )
    uids = {os.geteuid(), 0}
    if not parent.st_mode & stat.S_IWOTH:
        uids.add(st.st_uid)  # nobody but the parent's owners could have made it: its owner is the operator's choice
    return uids


def _check_daemon(sock: socket.socket, runtime_dir: Path) -> None:
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    trusted = trusted_daemon_uids(runtime_dir)
    if uid not in trusted:
        raise MmfeatError(
            ErrorCode.FORBIDDEN,
            f"the process serving {runtime_dir} (pid {pid}) runs as uid {uid}, not as one of {sorted(trusted)}: "
            "it may be another user's fake daemon; nothing was sent to it. Check who owns the runtime dir",
        )


def open_fd_channel(path: Path, session: bytes, timeout: float,
                    pools: bool = True) -> tuple[socket.socket, dict[int, int], int]:
    """Connect, authenticate, receive fds. Returns the open socket (keep it: closing it tells the daemon
    this client is gone), ``{pool_id: fd}`` and the lease table's fd; the caller owns the fds. ``pools``
    False: ask for the lease table's fd alone (a control-only client)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    fds: list[int] = []
    try:
        try:
            sock.connect(str(path))
            _check_daemon(sock, path.parent)
            sock.sendall(handshake.hello(session, pools))
            data, fds, flags, _ = socket.recv_fds(sock, handshake.MAX_HANDSHAKE_BYTES, _MAX_FDS)
        except (socket.timeout, ConnectionError, FileNotFoundError) as exc:
            raise DaemonUnavailableError(f"fd channel {path}: {exc}") from None
        if flags & socket.MSG_CTRUNC:
            raise FdLimitError("the daemon's pool fds did not fit this process's fd limit and were dropped in transit: "
                               "raise the limit (ulimit -n, LimitNOFILE=) or close fds")
        if not data:
            raise DaemonUnavailableError(f"fd channel {path} closed during the handshake")
        pools = handshake.parse_answer(data, len(fds))
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
