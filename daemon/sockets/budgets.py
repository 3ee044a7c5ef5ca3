"""The daemon's own resources: its fd limit, its anonymous memory, and the budgets that follow.

Peers can make the daemon hold fds (connections) and memory (what libzmq queues for them). The
daemon raises its fd limit as far as it may at start, derives how many connections fit, and watches
its anonymous memory against a budget that grows with its connections.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import resource
from typing import Optional

log = logging.getLogger("mmfeatd")

# Below this fd limit a burst of connections can exhaust the fds before the daemon sheds them, and
# libzmq 4.3 aborts the process when accept() on an ipc listener fails with EMFILE. So the daemon
# refuses to start instead of dying later from a client.
MIN_FD_LIMIT = 4096
# fds kept for everything that is not a client connection: pools, lease table, listeners, libzmq's
# own, the metrics server, log files.
FD_RESERVE = 64
# What one client process may hold: its control DEALER, its fallback probe's, its fd channel, and one
# to spare (a second Client in the same process, a tool). Connections may use half the fd limit; the
# other half is headroom for a burst of connections that libzmq accepts before the daemon can shut them
# down.
FDS_PER_CLIENT = 4
_HEADROOM = 2
# libzmq holds tens of KiB per idle connection; 64 KiB per allowed connection, comfortably above that,
# plus a fixed allowance, is what peers may make the daemon hold before the control socket is reset.
BYTES_PER_CONNECTION = 64 << 10
# The ledger's own record of a live lease (with its slot and expiry entry) is a few hundred bytes.
BYTES_PER_LEASE = 1 << 10
# libzmq's threads free a reset socket's queues after close returns, over the next moments and later on
# a loaded machine; a trim before then gives nothing back. So the heap is trimmed, and the guard's base
# set again, at each of these delays after a reset.
SETTLE_AFTER_S = (0.25, 1.0, 4.0)


class FdLimitError(Exception):
    """The fd limit is too low to survive a connection flood."""


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; return the limit in force, or raise FdLimitError."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass
    if soft < MIN_FD_LIMIT:
        raise FdLimitError(
            f"the fd limit is {soft} (hard {hard}); mmfeatd needs at least {MIN_FD_LIMIT}: libzmq aborts the whole "
            "process when a flood of connections exhausts it. "
            "Raise LimitNOFILE (the shipped unit sets 65536) or ulimit -Hn; "
            "in a container, docker or podman run --ulimit nofile=65536:65536"
        )
    return soft


def client_budget(fd_limit: int, max_clients: int) -> int:
    """Clients that fit: ``max_clients`` when set, else what the fd limit allows (at least 1)."""
    fit = max(1, (fd_limit - FD_RESERVE) // (FDS_PER_CLIENT * _HEADROOM))
    if max_clients and max_clients > fit:
        log.warning("max_clients %d needs %d fds but the limit is %d: using %d; raise LimitNOFILE",
                    max_clients, max_clients * FDS_PER_CLIENT * _HEADROOM + FD_RESERVE, fd_limit, fit)
    return min(max_clients, fit) if max_clients else fit


def anon_bytes(statm: int) -> int:
    """Resident anonymous memory of this process (RSS less file-backed and shared pages). ``statm``: an
    fd of /proc/self/statm kept open, read again from its start (opening it each time costs far more)."""
    fields = os.pread(statm, 128, 0).split()
    return (int(fields[1]) - int(fields[2])) * resource.getpagesize()


_libc: Optional[ctypes.CDLL] = None


def malloc_trim() -> None:
    """Give freed heap pages back to the kernel (glibc keeps them otherwise, after a flood)."""
    global _libc
    if _libc is None:
        # The symbols already loaded (libc's among them): find_library would fork ldconfig from the loop.
        _libc = ctypes.CDLL(None)
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


class MemoryGuard:
    """Is the daemon holding more than its budget? ``base`` plus a fixed allowance plus a share per
    connection and per live lease. After a reset the base moves to what memory settled at, so a heap
    the allocator cannot shrink does not make the guard reset again and again; it comes back down as
    the freed queues go back to the system."""

    def __init__(self, allowance: int) -> None:
        self.allowance = allowance
        # Read ten times a second while clients are connected: kept open.
        self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        self.base = self._floor = anon_bytes(self._statm)
        self._settles: list[float] = []

    def over(self, connections: int, leases: int) -> Optional[int]:
        """The bytes over budget, or None. Live leases grow the budget too: a large max_leases is the
        operator's choice, not a peer's attack."""
        used = anon_bytes(self._statm) - self.base
        budget = self.allowance + connections * BYTES_PER_CONNECTION + leases * BYTES_PER_LEASE
        return used - budget if used > budget else None

    def reset_at(self, now: float) -> None:
        """The control socket was reset at ``now``: settle at once (the base must cover what is still
        being freed, or the guard trips again) and at each of SETTLE_AFTER_S after it."""
        self._settles = [now + delay for delay in SETTLE_AFTER_S]
        self._settle(may_rise=True)

    @property
    def next_settle(self) -> float:
        """When the next settle after a reset is due (math.inf: none)."""
        return self._settles[0] if self._settles else math.inf

    def settle(self, now: float) -> None:
        """Run the settles due at ``now``."""
        due = [at for at in self._settles if at <= now]
        if due:
            self._settles = self._settles[len(due):]
            self._settle(may_rise=False)

    def _settle(self, may_rise: bool) -> None:
        # Only the reset's own settle may raise the base. Later ones run with peers connected again:
        # what they hold then is in their budget already, and taking it into the base would let each
        # reset's schedule (public, and seen by a peer as its dropped connection) ratchet the guard up.
        malloc_trim()
        settled = max(self._floor, anon_bytes(self._statm) - self.allowance // 4)
        self.base = settled if may_rise else min(self.base, settled)

    def close(self) -> None:
        if self._statm >= 0:
            os.close(self._statm)
            self._statm = -1
