"""The mesh's sockets and who may use them: the keys the ZAP handler lets in (the live set, changed as
the peers' source changes), each peer's DEALER with its handshake monitor, and the listener's
connections by the key they proved, so that a key taken away ends the connections it opened.

libzmq has no call that closes one connection of a ROUTER. Each message a ROUTER receives carries the
fd of its connection (ZMQ_SRCFD) and the key of its sender (User-Id): the fds a key used are kept with
the connection's remote address and port, and ending a key shuts those sockets down (libzmq sees the
end and closes them itself; the peer's reconnection is then refused by ZAP). A fd is shut down only
while it is still the same connection: the same remote address and port, to the listener's own port.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from mmfeat.protos.mesh import MAX_MESH_FRAME

from ..config import MeshConfigError, Settings
from .keys import SECRET_FILE, credential

log = logging.getLogger("mmfeatd.mesh")

# Messages queued per peer and direction: heartbeats, checks and ack batches; a peer that does not
# read loses what is past this (a check then times out, acks fall to the owner's ack_ttl).
HWM = 1024
# Connections remembered per key: a peer reconnects now and then, and a key cannot make this grow.
_FDS_PER_KEY = 16


class KeyList:
    """The ZAP handler's question: is this public key a listed peer? Runs on the authenticator's thread;
    ``allowed`` is replaced whole (never changed in place) when the listing changes."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, 8, ...: a scanner cannot flood the log
            log.warning("mesh: refused a connection with an unlisted public key (%d so far); list it in this "
                        "node's peers (or its source) if it is one of ours", self.refused)
        return False


def secret_file(settings: Settings, environ: Optional[dict[str, str]] = None) -> Path:
    """Where this node's secret key is: the setting (which a config file's directory fills in), else
    what systemd handed over in its credentials directory."""
    if settings.mesh_secret_file is not None:
        return settings.mesh_secret_file
    environ = dict(os.environ) if environ is None else environ
    handed = credential(environ)
    if handed is not None:
        return handed
    if environ.get("CREDENTIALS_DIRECTORY"):
        return Path(environ["CREDENTIALS_DIRECTORY"]) / SECRET_FILE
    raise MeshConfigError("listen is set but no mesh secret key is: run mmfeatd --gen-keys DIR in the config "
                          "file's directory, set mesh_secret_file, or under systemd install deploy/mmfeatd-mesh.conf "
                          "as the unit's drop-in (LoadCredential=mesh.secret:PATH)")


def limit(sock: zmq.Socket) -> None:
    sock.linger = 0
    sock.maxmsgsize = MAX_MESH_FRAME
    sock.sndhwm = sock.rcvhwm = HWM


def open_dealer(ctx: zmq.Context, endpoint: str, server_key: str, public: bytes,
                secret: bytes) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to a peer's listener, and the monitor of its handshakes."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.curve_serverkey = server_key.encode()
    dealer.curve_secretkey, dealer.curve_publickey = secret, public
    dealer.ipv6 = endpoint.startswith("tcp://[")
    limit(dealer)
    # Without this, a peer whose ZAP refuses our key looks like one that never answers.
    monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    dealer.connect(endpoint)
    return dealer, monitor


def handshake_events(monitor: zmq.Socket) -> list[int]:
    """What a DEALER's monitor reported since the last call (a bounded number at a time)."""
    events = []
    for _ in range(64):
        try:
            events.append(recv_monitor_message(monitor, zmq.NOBLOCK)["event"])
        except zmq.Again:
            break
    return events


def close_dealer(dealer: zmq.Socket, monitor: Optional[zmq.Socket]) -> None:
    if monitor is not None:
        dealer.disable_monitor()
        monitor.close(0)
    dealer.close(0)


class Inbound:
    """The listener's connections by the key each proved: key -> {fd: (remote address, port)}."""

    def __init__(self, port: int, is_ours: Callable[[int], bool]) -> None:
        self._port = port  # the listener's: a connection to another port is not one of its own
        self._is_ours = is_ours
        self._by_key: dict[str, OrderedDict[int, tuple[str, int]]] = {}
        self.ended = 0  # connections shut down because their key was taken away

    def seen(self, key: str, frame: zmq.Frame) -> None:
        """A message from ``key`` came in ``frame``: remember its connection. Looked at for every message
        (a system call): a peer that reconnected may have the same fd number on another connection."""
        fd = _srcfd(frame)
        peer = None if fd is None else self._peer_of(fd)
        if fd is None or peer is None:
            return
        fds = self._by_key.setdefault(key, OrderedDict())
        if fds.get(fd) != peer:
            fds.pop(fd, None)
            if len(fds) >= _FDS_PER_KEY:  # the oldest is long closed, most likely
                fds.popitem(last=False)
            fds[fd] = peer

    def end(self, key: str) -> int:
        """Shut down every connection ``key`` opened that is still open; how many."""
        n = sum(self._shut_down(fd, peer) for fd, peer in self._by_key.pop(key, {}).items())
        self.ended += n
        return n

    def end_frame(self, frame: zmq.Frame) -> bool:
        """Shut down the connection ``frame`` came in on (a key no longer listed, whose handshake passed
        before the change): only if it is from the address the frame says, to the listener's port."""
        fd = _srcfd(frame)
        try:
            address = frame.get("Peer-Address")
        except zmq.ZMQError:
            return False
        peer = self._peer_of(fd) if fd is not None else None
        if peer is None or _plain(peer[0]) != _plain(address):
            return False
        ended = self._shut_down(fd, peer)
        self.ended += ended
        return ended

    def _peer_of(self, fd: int) -> Optional[tuple[str, int]]:
        """(address, port) of the remote end of ``fd`` if it is a connection to the listener's port."""
        if self._is_ours(fd):
            return None
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            return None
        try:
            if s.getsockname()[1] != self._port:
                return None
            address, port = s.getpeername()[:2]
            return _plain(address), port
        except OSError:
            return None
        finally:
            s.detach()

    def _shut_down(self, fd: int, peer: tuple[str, int]) -> bool:
        if self._peer_of(fd) != peer:
            return False  # closed meanwhile; the number may be another connection's now
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            return False
        try:
            s.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            s.detach()


def _srcfd(frame: zmq.Frame) -> Optional[int]:
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def _plain(ip: str) -> str:
    return ip[len("::ffff:"):] if ip.startswith("::ffff:") else ip
