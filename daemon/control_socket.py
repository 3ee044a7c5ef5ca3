"""The control socket: a ZeroMQ ROUTER on our own listening socket, with its connections counted and
capped, and a reset for when what peers queue in it grows past the memory budget.

libzmq (4.3) aborts the whole process when accept() on an ipc listener fails with EMFILE, and it
offers no limit on connections, nor on the frames of a message that never ends (they pile up in the
pipe until the last one arrives). So the daemon keeps its own books: a socket monitor reports every
accepted and closed connection with its fd, and a thread of its own (so that a busy loop never
delays it) shuts down each connection past ``max_connections`` at once; libzmq then closes it
itself. The cap sits at half the fd limit, so a burst has the other half to outrun that thread. And
when the daemon's anonymous memory outgrows its budget, the ROUTER is replaced by a fresh one: every
connection and whatever it queued is dropped, and clients reconnect on their own.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from .runtime_dir import SocketFile

log = logging.getLogger("mmfeatd")

# Frames between the request limit and this get a TOO_LARGE reply; beyond it ZMQ drops the peer.
HARD_FRAME_LIMIT = 256 << 10
# Per peer: a client waits for each call and pipelines only quiet requests, so a few hundred is
# plenty; a peer that never reads its replies loses them instead of growing the daemon.
SEND_HWM = 128
RECV_HWM = 1024
# MONITOR_STOPPED is the last event of a monitor (close or reset): the thread wakes for it at once
# instead of polling a stop flag.
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
_IDLE_WAIT_S = 1.0  # how often the thread looks at its stop flag when nothing happens (a safety net)
# Replies queued in ZMQ's I/O thread when the loop ends (the ack that finished a drain) still go out.
REPLY_LINGER_MS = 500

IsOurs = Callable[[int], bool]


class ControlSocket:
    def __init__(self, ctx: zmq.Context, path: Path, endpoint: str, mode: int, max_connections: int, is_ours: IsOurs) -> None:
        self._ctx = ctx
        self._path = path
        self.endpoint = endpoint
        self._mode = mode
        self.max_connections = max_connections
        self._is_ours = is_ours  # fds the daemon itself owns: never shut one of those down
        self.router: Optional[zmq.Socket] = None
        self._file: Optional[SocketFile] = None
        self._conns: set[int] = set()  # the monitor thread's; others only read its size
        self.refused = 0
        self.resets = 0
        # The reading end of the newest ROUTER's monitor, made in _bind and taken over by the thread.
        self._next_monitor: Optional[zmq.Socket] = None
        self._handoff = threading.Lock()  # also the memory barrier a ZMQ socket needs to change threads
        self._changed = threading.Event()  # a new reader was handed over, or the thread is to stop
        self._stop = threading.Event()
        self._bind(SocketFile(self._path, socket.SOCK_STREAM, self._mode))
        self._thread = threading.Thread(target=self._watch, name="mmfeatd-connections", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _bind(self, file: SocketFile) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.maxmsgsize = HARD_FRAME_LIMIT
        router.sndhwm, router.rcvhwm = SEND_HWM, RECV_HWM
        # Our own listening socket, handed to ZeroMQ: made with the right mode, and libzmq will not
        # unlink the file at close (we do, only if it is still ours).
        self._file = file
        router.setsockopt(zmq.USE_FD, self._file.sock.detach())
        monitor_addr = f"inproc://mmfeatd-monitor-{self.resets}"
        router.monitor(monitor_addr, _MONITOR_EVENTS)
        # libzmq's I/O thread sends each event with a blocking send while it holds the ROUTER's monitor
        # lock, which disable_monitor() (called with the GIL held) also takes. A bounded queue, or none
        # yet, can block that send until this thread reads, and this thread needs the GIL: a deadlock
        # on stop under a connection churn. So the reading end exists before the first event and its
        # queue has no bound (events are a few dozen bytes, and the thread catches up).
        reader = self._ctx.socket(zmq.PAIR)
        reader.linger = 0
        reader.rcvhwm = 0
        reader.connect(monitor_addr)
        router.bind(self.endpoint)
        self.router = router
        with self._handoff:
            if self._next_monitor is not None:  # never taken: the thread had not caught up
                self._next_monitor.close()
            self._next_monitor = reader
            self._changed.set()

    def _watch(self) -> None:
        # Sleeps until a connection event, the end of a monitor or a hand-over: an idle daemon's thread
        # costs nothing. A reader is closed only after its monitor said MONITOR_STOPPED, or once the
        # stop flag is set, which close() does only after the monitor went (see _bind).
        monitor = None
        try:
            while True:
                with self._handoff:
                    fresh, self._next_monitor = self._next_monitor, None
                    self._changed.clear()  # under the lock: a hand-over after this sets it again
                if fresh is not None:  # the first ROUTER, or a reset: follow the new one
                    if monitor is not None:
                        monitor.close()
                    monitor, self._conns = fresh, set()
                if self._stop.is_set():
                    return
                if monitor is None:
                    self._changed.wait(_IDLE_WAIT_S)
                    continue
                if not monitor.poll(_IDLE_WAIT_S * 1000):
                    continue
                try:
                    event = recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                        monitor.close()
                        monitor = None
                    else:
                        self._count(event)
                except zmq.ContextTerminated:
                    raise
                except Exception:  # noqa: BLE001 - this thread must outlive any one event (see close)
                    log.exception("control socket: a connection event could not be handled")
        except zmq.ContextTerminated:
            pass
        finally:
            if monitor is not None:
                monitor.close()

    def _count(self, event: dict) -> None:
        fd = event["value"]
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._conns.discard(fd)
        elif event["event"] == zmq.EVENT_ACCEPTED:
            self._conns.add(fd)
            if len(self._conns) > self.max_connections:
                self._refuse(fd)

    def _refuse(self, fd: int) -> None:
        # The event is read after the fact: the fd may already belong to something else. Ours are
        # skipped; any other is a libzmq connection, and shutting one down only disconnects a peer.
        if self._is_ours(fd):
            return
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            return  # closed meanwhile, or not a socket
        try:
            s.shutdown(socket.SHUT_RDWR)  # libzmq sees the end of the connection and closes the fd itself
            self.refused += 1
        except OSError:
            pass
        finally:
            s.detach()
        if self.refused & (self.refused - 1) == 0:  # log at 1, 2, 4, 8, ... refusals
            log.warning(
                "control socket: %d connections, the max_connections limit; refused a new one (%d so far). "
                "Raise LimitNOFILE and max_connections, or find the process that opens them", len(self._conns), self.refused,
            )

    def reset(self, why: str) -> None:
        """Drop every connection and what it queued, and listen again on a fresh socket."""
        self.resets += 1
        log.warning("control socket reset: %s; every client reconnects and repeats the request in flight", why)
        fresh = SocketFile(self._path, socket.SOCK_STREAM, self._mode)  # takes the path over at once
        self._close(linger=0)  # the old file is no longer at the path: nothing is unlinked
        self._bind(fresh)

    def _close(self, linger: int) -> None:
        if self.router is not None:
            self.router.disable_monitor()
            self.router.close(linger=linger)
            self.router = None
        if self._file is not None:
            self._file.unlink()
            self._file = None

    def close(self) -> None:
        # The monitor goes while its reader is still there (see _bind): an event sent to a reader
        # that had gone would block libzmq's I/O thread, and disable_monitor() with it, for good.
        self._close(linger=REPLY_LINGER_MS)
        self._stop.set()
        self._changed.set()
        self._thread.join(2.0)
        with self._handoff:
            if self._next_monitor is not None:
                self._next_monitor.close()
                self._next_monitor = None
