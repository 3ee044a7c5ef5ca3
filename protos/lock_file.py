"""The serving daemon's lock on ``mmfeatd.lock``, and a query of it that takes nothing (SPEC.md, section 1).

The daemon holds an exclusive open-file-description (OFD) record lock over the whole file. A client asks
``F_OFD_GETLK`` whether a write lock would conflict: the query takes no lock, so no number of clients
probing a directory can ever keep a starting daemon out. On Linux, flock() locks and record locks do
not see each other, and releases before this one lock and probe with flock alone: so the daemon holds
an exclusive flock as well (a client of such a release probes with a shared one), and writes ``ofd``
under its pid, so that a client knows whether the last daemon's lock is one its query would see.
"""

from __future__ import annotations

import errno
import fcntl
import struct

OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
# struct flock on Linux (x86-64 and aarch64 alike): l_type, l_whence, l_start, l_len, l_pid, padding.
_FLOCK = "hhqqi4x"
# The lock file's second line, from a daemon that holds the OFD lock.
OFD_MARK = "ofd"


def lock(fd: int) -> None:
    """Take the OFD write lock over the whole file without waiting; OSError (EAGAIN) if it is held.
    ``fd`` must be open for writing; the lock lasts until every fd of that open file is closed."""
    try:
        fcntl.fcntl(fd, OFD_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, 0, 0, 0))
    except OSError as exc:
        if exc.errno == errno.EACCES:  # what some kernels say for a conflicting record lock
            raise OSError(errno.EAGAIN, exc.strerror) from None
        raise


def held(fd: int) -> bool:
    """Whether a process holds an OFD lock on the file that a write lock would conflict with. Takes
    nothing; any fd of the file will do, a read-only one included."""
    reply = fcntl.fcntl(fd, OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, 0, 0, 0))
    return struct.unpack(_FLOCK, reply)[0] != fcntl.F_UNLCK


def contents(pid: int) -> bytes:
    """What the daemon writes into the lock file once it holds it."""
    return f"{pid}\n{OFD_MARK}\n".encode()
