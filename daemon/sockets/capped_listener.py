"""A ZeroMQ socket that listens on our own listening socket file, its connections counted and capped.

The control socket and the key feed both take this shape: the file is made with the right mode by
SocketFile (and unlinked only while it is still ours, which libzmq would not check), and a ConnectionCap
sheds connections past its limit, since libzmq aborts the process on EMFILE in accept. A reset replaces
the socket and its file at once, dropping every connection and whatever it queued.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

import zmq

from .connection_cap import ConnectionCap
from .runtime_dir import SocketFile


class CappedListener:
    def __init__(self, ctx: zmq.Context, kind: int, path: Path, endpoint: str, mode: int, cap: ConnectionCap) -> None:
        self._ctx = ctx
        self._kind = kind
        self._path = path
        self.endpoint = endpoint
        self._mode = mode
        self._cap = cap
        self.sock: Optional[zmq.Socket] = None
        self._file: Optional[SocketFile] = None
        try:
            self._bind(SocketFile(self._path, socket.SOCK_STREAM, self._mode))
        except BaseException:
            # A listener that cannot bind leaves no thread behind (the key feed's daemon runs on without it).
            self._close(linger=0)
            self._cap.close()
            raise

    @property
    def connections(self) -> int:
        return self._cap.connections

    @property
    def refused(self) -> int:
        return self._cap.refused

    @property
    def max_connections(self) -> int:
        return self._cap.max_connections

    def _configure(self, sock: zmq.Socket) -> None:
        """The socket's own options, set before it binds."""

    def _bind(self, file: SocketFile) -> None:
        self._file = file
        sock = self._ctx.socket(self._kind)
        try:
            sock.linger = 0
            self._configure(sock)
            # Our own listening socket, handed to ZeroMQ: made with the right mode, and libzmq will not
            # unlink the file at close (we do, only if it is still ours).
            sock.setsockopt(zmq.USE_FD, file.sock.detach())
            self._cap.watch(sock)
            sock.bind(self.endpoint)
        except BaseException:
            self._cap.unwatch(sock)
            sock.close(linger=0)
            raise
        self.sock = sock

    def _replace(self) -> None:
        """Drop every connection and what it queued, and listen again on a fresh socket."""
        fresh = SocketFile(self._path, socket.SOCK_STREAM, self._mode)  # takes the path over at once
        self._close(linger=0)  # the old file is no longer at the path: nothing is unlinked
        self._bind(fresh)

    def _close(self, linger: int) -> None:
        if self.sock is not None:
            self._cap.unwatch(self.sock)
            self.sock.close(linger=linger)
            self.sock = None
        if self._file is not None:
            self._file.sock.close()  # nothing once ZeroMQ took it over; else it would leak
            self._file.unlink()
            self._file = None

    def close(self, linger: int = 0) -> None:
        self._close(linger=linger)
        self._cap.close()
