"""A client's session with its daemon: the hello, the fd channel that keeps the session alive, the
pool mappings, and the requests that travel on the fd channel (publish, ack, release, ping).

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
from pathlib import Path
from typing import Any, Optional

from mmfeat.protos.codec import decode, encode
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.messages import REQUEST_MODELS
from mmfeat.protos.paths import fd_socket_path
from mmfeat.protos.version import PROTOCOL_VERSION

from mmfeat import atomics

from . import fd_budget
from . import mapping as mapping_cache
from .arena import ArenaSet
from .async_failures import AsyncFailures
from .channel import ControlChannel
from .fd_receiver import open_fd_channel
from .table import LeaseTableView, map_lease_table

_MAX_DATAGRAM = 4096
# Threads share the fd channel: another thread may read our reply (and file it for us) while we sleep in
# poll(), which then sees nothing to read. So a waiter looks again at least this often.
_SHARED_WAIT_S = 0.005
# alive() reads the channel at most this often: a recv per put, get and ack would be the largest cost of
# the shared-memory path. A daemon restart is noticed within it (its descriptors are STALE anyway).
_ALIVE_EVERY_S = 0.001


class Session:
    def __init__(
        self,
        hello: dict[str, Any],
        endpoint: str,
        fd_sock: socket.socket,
        fds: dict[int, int],
        table: LeaseTableView,
        timeout: float,
        failures: AsyncFailures,
        readonly: bool = False,
    ) -> None:
        self.token: bytes = hello["session"]
        self.epoch: int = hello["epoch"]
        self.node: str = hello["node"]
        self.reserve_ttl: float = float(hello.get("reserve_ttl", 30.0))
        self.endpoint = endpoint
        self.pools: dict[int, dict[str, Any]] = {p["pool"]: p for p in hello["pools"]}
        self.mappings: dict[tuple[int, int], Any] = {}  # (pool id, device) -> HostMapping or CudaMapping
        self.fds = fds  # pool fds kept for pools mapped lazily (GPU pools: once per device)
        self.pid = os.getpid()  # the process that opened it: a forked child must open its own
        self.table = table
        self.timeout = timeout
        self.failures = failures
        self.readonly = readonly  # pools mapped read-only: this process only consumes
        self._sock = fd_sock
        self._readable = select.poll()
        self._readable.register(fd_sock, select.POLLIN)
        self._ids = itertools.count(1)
        self._read_lock = threading.Lock()
        self._answered = 0  # the highest ping id the daemon has answered on this channel
        self._waiting: set[int] = set()  # ids of calls waiting for their reply
        self._replies: dict[int, dict[str, Any]] = {}
        self.send_deadlines = False  # set by open_session once the daemon's clock is known to be ours
        self._closed = False
        self._gone = False
        self._next_check = 0.0
        # The shared-memory path: arenas to publish in, and acks added in the lease table.
        self.arenas: Optional[ArenaSet] = ArenaSet(self) if table.writable else None

    # --- liveness and replies ------------------------------------------------------------------

    def alive(self) -> bool:
        """False once the daemon closed the channel (it exited or restarted). Reads and logs the error
        replies of failed fd-channel requests on the way: they are the only other thing it sends."""
        if self._closed or self._gone or self.pid != os.getpid():
            return False
        now = time.monotonic()
        if now < self._next_check:
            return True
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
            if isinstance(reply.get("arena"), dict):
                # An arena granted after its request timed out: nobody will place features in it.
                try:
                    self.send("arena_return", arena=reply["arena"].get("id"))
                except DaemonUnavailableError:
                    pass  # the session is ending: the daemon takes its arenas back anyway
            return
        err = reply.get("error")
        err = err if isinstance(err, dict) else {}
        # A quiet request's id is its op (send()), so the failure is counted under the op that failed.
        op = rid if isinstance(rid, str) and rid in REQUEST_MODELS else "request"
        self.failures.record(op, str(err.get("code")), str(err.get("message")))

    # --- requests on the fd channel ------------------------------------------------------------

    def send(self, op: str, quiet: bool = True, req_id: Optional[int] = None, **fields: Any) -> None:
        """One request on the fd channel; returns once the daemon's socket buffer holds it."""
        frame = encode({"v": PROTOCOL_VERSION, "op": op, "id": req_id if req_id is not None else op,
                        "quiet": quiet, **fields})
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

    def publish(self, lease: dict[str, Any]) -> None:
        self.send("publish", lease=lease)

    def try_send(self, op: str, **fields: Any) -> bool:
        """A quiet request on the fd channel if the daemon's socket buffer has room now; False if not."""
        frame = encode({"v": PROTOCOL_VERSION, "op": op, "id": op, "quiet": True, **fields})
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
            fields["deadline"] = deadline
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
        if reply.get("ok"):
            return reply
        raise MmfeatError.from_reply(reply)

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
        if reply.get("ok"):
            return reply
        raise MmfeatError.from_reply(reply)

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

    # --- mappings ------------------------------------------------------------------------------

    def pool_on_local_device(self, ordinal: int) -> Optional[dict[str, Any]]:
        """The GPU pool on this process's CUDA device ``ordinal``, matched by GPU UUID: the daemon and
        this process may number GPUs differently (CUDA_VISIBLE_DEVICES in a pod)."""
        from mmfeat.cuda_driver import local_ordinal

        for info in self.pools.values():
            if info["kind"] == "cuda" and local_ordinal(info) == ordinal:
                return info
        return None

    def mapping(self, pool_id: int, device: Optional[int] = None) -> Any:
        """The process-wide mapping of a pool: host pools once, GPU pools once per device (default: the
        caller's current one)."""
        info = self.pools[pool_id]
        if info["kind"] == "host":
            key = (pool_id, -1)
            if key not in self.mappings:
                fd = self.fds.pop(pool_id, None)
                if fd is None:
                    raise MmfeatError(ErrorCode.INTERNAL, f"daemon sent no fd for host pool {pool_id}")
                self.mappings[key] = mapping_cache.map_host_pool(
                    self.endpoint, pool_id, info["epoch"], fd, info["size"], self.readonly)
            return self.mappings[key]
        if device is None:
            import torch

            device = torch.cuda.current_device()
        key = (pool_id, device)
        if key not in self.mappings:
            from .cuda_import import map_cuda_pool

            fd = self.fds.get(pool_id)
            self.mappings[key] = map_cuda_pool(self.endpoint, info, os.dup(fd) if fd is not None else None,
                                               self.readonly)
        return self.mappings[key]

    def close(self) -> None:
        self._closed = True
        if self.arenas is not None:
            self.arenas.close()
        self._sock.close()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _wait(sock: socket.socket, event: int, timeout: float) -> bool:
    # poll, not select: select fails outright in a process with more than 1024 fds open.
    poller = select.poll()
    poller.register(sock.fileno(), event)
    return bool(poller.poll(max(0, int(timeout * 1000))))


def open_session(channel: ControlChannel, runtime_dir: Path, name: str, timeout: float,
                 readonly: bool = False) -> Session:
    """hello, the fd channel handshake (which checks who serves it), the lease table and the host pools
    (read-only with ``readonly``). FdLimitError, before anything is half open, when this process cannot
    spare the fds that takes."""
    try:
        return _open_session(channel, runtime_dir, name, timeout, readonly)
    except OSError as exc:
        if fd_budget.is_exhaustion(exc):
            raise fd_budget.exhausted(exc, "opening a session with mmfeatd") from None
        raise


def _open_session(channel: ControlChannel, runtime_dir: Path, name: str, timeout: float,
                  readonly: bool) -> Session:
    # One pool for the count before hello (a daemon has at least one); the exact count once it says.
    fd_budget.ensure(fd_budget.session_fds(1), "opening a session with mmfeatd")
    sent = time.monotonic()
    hello = channel.call("hello", name=name[:128], pid=os.getpid())
    # Same kernel, same CLOCK_MONOTONIC (unless a time namespace shifts it): then deadlines mean the same.
    clock = hello.get("clock")
    channel.send_deadlines = isinstance(clock, (int, float)) and sent - 1.0 <= clock <= time.monotonic() + 1.0
    fd_budget.ensure(fd_budget.session_fds(len(hello["pools"])), "opening a session with mmfeatd")
    fd_sock, fds, table_fd = open_fd_channel(fd_socket_path(runtime_dir), hello["session"], timeout)
    try:
        # Writable only where this process will publish and ack in it (SPEC.md, section 9).
        writable = bool(hello.get("arenas")) and atomics.AVAILABLE
        table = map_lease_table(channel.endpoint, hello["epoch"], table_fd, hello["table_slots"], writable)
    except BaseException:
        fd_sock.close()
        for fd in fds.values():
            os.close(fd)
        raise
    session = Session(hello, channel.endpoint, fd_sock, fds, table, timeout, channel.failures, readonly)
    session.send_deadlines = channel.send_deadlines
    try:
        for pool_id, info in session.pools.items():
            if info["kind"] == "host":  # map host pools now; GPU pools on first use, on the caller's device
                session.mapping(pool_id, None)
    except BaseException:
        session.close()
        raise
    return session
