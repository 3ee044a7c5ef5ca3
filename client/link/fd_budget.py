"""Whether this process has the file descriptors that reaching the daemon takes, counted before any is taken.

libzmq aborts the whole process (SIGABRT) when it cannot create the epoll fd of a context's thread, and
the other steps fail half way with EMFILE. A server near its RLIMIT_NOFILE must get the inline fallback
or a typed error instead, so each step that takes fds counts the free ones first, and EMFILE or ENFILE
from any step becomes FdLimitError.
"""

from __future__ import annotations

import errno
import os
import resource
from typing import Optional

from mmfeat.protos.errors import FdLimitError

# The first socket of a ZeroMQ context starts its threads: the reaper's and the I/O thread's mailbox and
# epoll each, beside the context's own mailbox.
ZMQ_CONTEXT_FDS = 5
# A DEALER socket: its mailbox, and the connection its I/O thread opens to the daemon.
ZMQ_SOCKET_FDS = 2
# Other threads of this process may open files between the count and the step.
SPARE_FDS = 4


def session_fds(pools: int) -> int:
    """What opening a session takes at its peak: the fd channel's socket, the fd of each pool and of the
    lease table as received, and the duplicate that Python's mmap keeps of the one being mapped."""
    return 1 + pools + 1 + 1


def free_fds() -> Optional[int]:
    """File descriptors this process may still open under RLIMIT_NOFILE; None when it cannot tell."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        names = os.listdir("/proc/self/fd")
    except OSError as exc:
        return 0 if is_exhaustion(exc) else None
    # Numbers at or above the limit (opened before it was lowered) take no slot under it; the listing's
    # own fd, the lowest free one, is among the names and free again now.
    used = sum(1 for n in names if n.isdigit() and int(n) < soft) - 1
    return max(0, soft - used)


def ensure(needed: int, what: str) -> None:
    """Raise FdLimitError unless ``needed`` fds (and a spare few) are free for ``what``."""
    free = free_fds()
    if free is not None and free < needed + SPARE_FDS:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise FdLimitError(
            f"{what} needs {needed + SPARE_FDS} free file descriptors and this process has {free} of its limit "
            f"of {soft} (RLIMIT_NOFILE): raise the limit (ulimit -n, LimitNOFILE=) or close fds"
        )


def is_exhaustion(exc: BaseException) -> bool:
    """True for EMFILE (this process's limit) and ENFILE (the system's file table)."""
    return getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE)


def exhausted(exc: BaseException, what: str) -> FdLimitError:
    """The FdLimitError for an EMFILE or ENFILE that ``what`` met."""
    scope = "the system's file table is full" if getattr(exc, "errno", None) == errno.ENFILE else (
        "this process reached its fd limit (RLIMIT_NOFILE): raise it (ulimit -n, LimitNOFILE=) or close fds")
    return FdLimitError(f"{what} ran out of file descriptors: {scope}")
