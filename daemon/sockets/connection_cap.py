"""A ZeroMQ ROUTER's connections, counted and capped from its socket monitor.

libzmq (4.3) aborts the whole process when accept() fails with EMFILE, and offers no limit on
connections. So the daemon keeps its own books: the socket monitor reports every accepted and closed
connection with its fd, and a thread of its own (so that a busy loop never delays it) shuts down each
connection past ``max_connections`` at once; libzmq then closes it itself. The control socket and
the mesh listener each have one.

A cap may favour some connections (the mesh: those from listed peers' addresses): one that comes when
the cap is full takes the place of the oldest connection that is not favoured, so a flood from
elsewhere cannot keep a listed peer out. Favoured connections still count, and never exceed the cap.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from typing import Callable, Optional

import zmq

log = logging.getLogger("mmfeatd")

# MONITOR_STOPPED is the last event of a monitor (close or reset): the thread wakes for it at once
# instead of polling a stop flag.
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
_IDLE_WAIT_S = 1.0  # how often the thread looks at its stop flag when nothing happens (a safety net)
# While it follows a monitor the thread needs no net: its ROUTER is unwatched before a reset or a close,
# and the monitor's last event (MONITOR_STOPPED) wakes it. Each wake-up is cache-cold while payload
# copies flow, and with clients attached such fixed wake-ups are most of the daemon's CPU: this rare one
# is a last resort.
_MONITOR_WAIT_S = 30.0
# A monitor event's first frame (zmq_socket_monitor): the event's 16-bit id, then its 32-bit value (for
# ACCEPTED and DISCONNECTED, the connection's fd). Read here rather than with zmq.utils.monitor, whose
# import brings asyncio: a tenth of a daemon's start-up.
_EVENT = struct.Struct("=hi")

IsOurs = Callable[[int], bool]
Favoured = Callable[[socket.socket], bool]  # asked once per accepted connection


class ConnectionCap:
    def __init__(self, ctx: zmq.Context, name: str, max_connections: int, is_ours: IsOurs, advice: str,
                 favoured: Optional[Favoured] = None, on_accept: Optional[Callable[[], None]] = None) -> None:
        self._ctx = ctx
        self.name = name
        self.max_connections = max_connections
        self._is_ours = is_ours  # fds the daemon itself owns: never shut one of those down
        self._advice = advice  # what to do when connections are refused, for the log
        self._favoured = favoured
        self._on_accept = on_accept  # called on this thread for each connection kept
        # fd -> favoured, oldest first; the thread's, others only read its size.
        self._conns: dict[int, bool] = {}
        self.refused = 0
        self.evicted = 0  # connections shut down to make room for a favoured one
        self._watched = 0
        # The reading end of the newest ROUTER's monitor, made in watch() and taken over by the thread.
        self._next_monitor: Optional[zmq.Socket] = None
        self._handoff = threading.Lock()  # also the memory barrier a ZMQ socket needs to change threads
        self._changed = threading.Event()  # a new reader was handed over, or the thread is to stop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"mmfeatd-{name}-connections", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def watch(self, router: zmq.Socket) -> None:
        """Count ``router``'s connections from now on (call it before bind); a previous ROUTER must have
        been unwatched first."""
        self._watched += 1
        monitor_addr = f"inproc://mmfeatd-{self.name}-monitor-{self._watched}"
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
        with self._handoff:
            if self._next_monitor is not None:  # never taken: the thread had not caught up
                self._next_monitor.close()
            self._next_monitor = reader
            self._changed.set()

    @staticmethod
    def unwatch(router: zmq.Socket) -> None:
        """Stop counting ``router``: while the thread still reads (see watch), before the ROUTER closes."""
        router.disable_monitor()

    def _watch(self) -> None:
        # Sleeps until a connection event, the end of a monitor or a hand-over: an idle daemon's thread
        # costs nothing. A reader is closed only after its monitor said MONITOR_STOPPED, or once the
        # stop flag is set, which close() does only after the monitor went (see watch).
        monitor = None
        try:
            while True:
                with self._handoff:
                    fresh, self._next_monitor = self._next_monitor, None
                    self._changed.clear()  # under the lock: a hand-over after this sets it again
                if fresh is not None:  # the first ROUTER, or a reset: follow the new one
                    if monitor is not None:
                        monitor.close()
                    monitor, self._conns = fresh, {}
                if self._stop.is_set():
                    return
                if monitor is None:
                    self._changed.wait(_IDLE_WAIT_S)
                    continue
                if not monitor.poll(_MONITOR_WAIT_S * 1000):
                    continue
                try:
                    frames = monitor.recv_multipart()
                    event, value = _EVENT.unpack(frames[0])
                    if event == zmq.EVENT_MONITOR_STOPPED:
                        monitor.close()
                        monitor = None
                    else:
                        self._count(event, value)
                except zmq.ContextTerminated:
                    raise
                except Exception:  # noqa: BLE001 - this thread must outlive any one event (see close)
                    log.exception("%s: a connection event could not be handled", self.name)
        except zmq.ContextTerminated:
            pass
        finally:
            if monitor is not None:
                monitor.close()

    def _count(self, event: int, fd: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            self._conns.pop(fd, None)
        elif event == zmq.EVENT_ACCEPTED:
            self._conns.pop(fd, None)  # a reused number: the newest connection goes last
            favoured = self._favoured is not None and self._with_socket(fd, self._favoured)
            if len(self._conns) < self.max_connections:
                self._conns[fd] = favoured
                if self._on_accept is not None:
                    self._on_accept()
                return
            victim = next((old for old, fav in self._conns.items() if not fav), None) if favoured else None
            if victim is not None:  # a favoured newcomer takes the oldest other connection's place
                del self._conns[victim]
                if self._shut_down(victim):
                    self.evicted += 1
                self._conns[fd] = True
            elif self._shut_down(fd):
                self.refused += 1
                self._log_refusal()

    def _with_socket(self, fd: int, use: Callable[[socket.socket], bool]) -> bool:
        """``use`` on the connection behind ``fd``; False if it is ours, gone, or not a socket. The event is
        read after the fact: the fd may already belong to something else. Ours are skipped; any other is
        a libzmq connection, and looking at one or shutting it down only affects that peer."""
        if self._is_ours(fd):
            return False
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            return False  # closed meanwhile, or not a socket
        try:
            return use(s)
        except OSError:
            return False
        finally:
            s.detach()

    def _shut_down(self, fd: int) -> bool:
        # libzmq sees the end of the connection and closes the fd itself (DISCONNECTED follows).
        return self._with_socket(fd, lambda s: s.shutdown(socket.SHUT_RDWR) is None)

    def _log_refusal(self) -> None:
        if self.refused & (self.refused - 1) == 0:  # log at 1, 2, 4, 8, ... refusals
            log.warning("%s: %d connections, its limit; refused a new one (%d so far). %s", self.name, len(self._conns),
                        self.refused, self._advice)

    def close(self) -> None:
        """Stop the thread; every watched ROUTER must have been unwatched first (see watch)."""
        self._stop.set()
        self._changed.set()
        self._thread.join(2.0)
        with self._handoff:
            if self._next_monitor is not None:
                self._next_monitor.close()
                self._next_monitor = None
