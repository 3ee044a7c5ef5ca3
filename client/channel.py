"""The control channel: a ZMQ DEALER that sends one request and waits, with a deadline, for its reply."""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any, Optional

import zmq

from mmfeat.protos.codec import decode, encode
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.version import PROTOCOL_VERSION


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

    def _socket(self) -> zmq.Socket:
        if self._sock is not None and self._pid != os.getpid():
            self._sock = None  # inherited across fork: never touch the parent's socket
        if self._sock is None:
            if self.endpoint.startswith("ipc://") and not os.path.exists(self.endpoint[6:]):
                raise DaemonUnavailableError(
                    f"no mmfeatd socket at {self.endpoint[6:]}: start mmfeatd or set MMFEAT_RUNTIME_DIR"
                )
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.linger = 0
            sock.immediate = 1  # do not queue requests for a daemon that is not there
            sock.sndtimeo = int(self.timeout * 1000)
            sock.connect(self.endpoint)
            self._sock, self._pid = sock, os.getpid()
        return self._sock

    def call(self, op: str, timeout: Optional[float] = None, **fields: Any) -> dict[str, Any]:
        """Send ``op`` and return the reply body; raise MmfeatError for an error reply and
        DaemonUnavailableError when no reply comes within ``timeout`` seconds."""
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            sock = self._socket()
            req_id = next(self._ids)
            try:
                sock.send(encode({"v": PROTOCOL_VERSION, "op": op, "id": req_id, **fields}))
            except zmq.Again:
                raise DaemonUnavailableError(f"mmfeatd at {self.endpoint} is not accepting requests ({op})") from None
            deadline = time.monotonic() + timeout
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    self._reset()
                    raise DaemonUnavailableError(f"mmfeatd at {self.endpoint} did not answer {op} within {timeout:g} s")
                reply = decode(sock.recv())
                if reply.get("id") == req_id:
                    break
                # A late reply to a request that already timed out, or to a cast: not ours.
        if reply.get("ok"):
            return reply
        err = reply.get("error") or {}
        try:
            code = ErrorCode(err.get("code"))
        except ValueError:
            code = ErrorCode.INTERNAL
        raise MmfeatError(code, str(err.get("message", "no message")))

    def cast(self, op: str, **fields: Any) -> None:
        """Send without waiting; the reply is dropped when it arrives. For counters only."""
        with self._lock:
            try:
                self._socket().send(encode({"v": PROTOCOL_VERSION, "op": op, "id": -next(self._ids), **fields}), zmq.NOBLOCK)
            except (zmq.Again, DaemonUnavailableError):
                pass

    def _reset(self) -> None:
        # After a timeout the socket may hold a half-finished exchange; a fresh one is cheaper to reason about.
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._reset()
