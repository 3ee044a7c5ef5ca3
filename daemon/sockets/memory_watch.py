"""The memory guard's clock: a thread that reads one /proc word every GUARD_S while peers are connected
and wakes the control loop only when the daemon is over its budget.

Someone must look on a timer: a peer that sends a message that never ends grows ZeroMQ's I/O thread
without ever waking the loop (libzmq hands a message over only once its last frame is in). The loop
is the wrong one to look. While features flow, each of its wake-ups starts with caches emptied by
payload copies and costs 0.3-1 ms at 16 MiB, so ten a second were most of the daemon's CPU; this
thread's wake-up runs a few lines and costs tens of microseconds.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from typing import Callable

from .budgets import MemoryGuard

log = logging.getLogger("mmfeatd")

# While peers are connected: a flooding peer grows the daemon by this interval's worth of its rate
# before the loop resets the socket, so the interval bounds the overshoot past control_memory_mb.
GUARD_S = 0.1
# With no peer and nothing live nobody can flood; a newcomer wakes the watch (see wake).
IDLE_S = 1.0

Load = Callable[[], tuple[int, int]]  # (connections, live leases), read from the loop's books


class MemoryWatch:
    """Sets ``tripped`` and calls ``ring`` (which wakes the loop) when ``guard`` finds the daemon over
    budget; the loop calls ``rearm`` once it has handled that. Only reads the loop's books."""

    def __init__(self, guard: MemoryGuard, load: Load, ring: Callable[[], None]) -> None:
        self._guard = guard
        self._load = load
        self._ring = ring
        self.tripped = False
        self._stopping = False
        self._long = False  # the thread sleeps IDLE_S: a newcomer must wake it
        self._pipe_lock = threading.Lock()  # wake() from another thread never writes to a closed fd
        # Wakes the thread early: a byte from wake() has it read the load again; close() sets _stopping first.
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="mmfeatd-memory-watch", daemon=True)
        self._thread.start()

    def rearm(self) -> None:
        self.tripped = False

    def wake(self) -> None:
        """A peer arrived: watch at GUARD_S from now, not after an idle second (any thread may call it)."""
        if self._long:
            self._long = False
            with self._pipe_lock:
                if self._stop_w >= 0:
                    try:
                        os.write(self._stop_w, b"w")
                    except BlockingIOError:
                        pass  # full: the thread wakes anyway

    def _run(self) -> None:
        pipe = (self._stop_r,)
        load, over, wait = self._load, self._guard.over, select.select
        try:
            while True:
                # One read of the books per wake-up, for the check and for the next interval: the wake-up
                # itself is most of the cost (cache-cold while payload copies flow), and it comes ten
                # times a second for as long as a client is attached.
                self._long = True  # before the load: a wake() from now on either writes or is seen by it
                connections, leases = load()
                if not self.tripped and over(connections, leases) is not None:
                    self.tripped = True
                    self._ring()
                if connections or leases:
                    self._long = False
                if wait(pipe, (), (), IDLE_S if self._long else GUARD_S)[0]:
                    if self._stopping:
                        return
                    os.read(self._stop_r, 4096)
        except Exception:  # noqa: BLE001 - a dead watch would leave floods unchecked: say so loudly
            log.exception("the memory watch stopped; control socket floods are no longer checked")

    def close(self) -> None:
        """Stop the thread before the guard's /proc fd closes (it reads it)."""
        self._stopping = True
        with self._pipe_lock:
            if self._stop_w < 0:
                return
            try:
                os.write(self._stop_w, b"x")
            except BlockingIOError:
                pass  # full of wake-ups: the thread wakes and sees _stopping
        self._thread.join(5.0)
        with self._pipe_lock:
            os.close(self._stop_w)
            os.close(self._stop_r)
            self._stop_w = self._stop_r = -1
