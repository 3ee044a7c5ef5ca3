"""Whether any process serves a runtime dir, known without a round trip.

A daemon killed by SIGKILL leaves its socket files behind: a ZeroMQ connect to them succeeds and a
request then waits out its whole timeout. The daemon's OFD lock on the lock file ends with its process,
so a query that finds no such lock (protos/lock_file.py; it takes nothing, and so never keeps a
starting daemon out) proves that no daemon serves the dir, and the file names the pid that did. A file
an earlier release's daemon wrote (no ``ofd`` line: it locked with flock alone, which the query does not
see) is probed as that release's clients did, with a shared flock dropped at once. The lock file is the
daemon user's alone (a process that can open it could lock it and keep every later daemon out), so a
client of another user asks the control socket instead: a socket file with nobody listening refuses a
connection at once.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path
from typing import Optional

from mmfeat.protos import lock_file
from mmfeat.protos.paths import CONTROL_SOCKET, lock_path

_TAIL = "its socket files are left over: start mmfeatd there (it replaces them) or set MMFEAT_RUNTIME_DIR"


def gone_daemon(runtime_dir: Path, ask_socket: bool = True) -> Optional[str]:
    """A message saying that no daemon holds ``runtime_dir``, when that is certain; None when one holds
    it or this process cannot tell (neither probe answers, or no fd to spare). ``ask_socket=False`` skips
    the control socket's probe, which costs a live daemon a connection."""
    free = _lock_free(runtime_dir)
    if free is None:
        if not ask_socket or not _refused(runtime_dir / CONTROL_SOCKET):
            return None
        return f"no daemon holds {runtime_dir} (its control socket refuses connections); {_TAIL}"
    if free is False:
        return None
    who = f"pid {free} is gone" if free.isdigit() else "its lock is free"
    return f"no daemon holds {runtime_dir} ({who}); {_TAIL}"


def _lock_free(runtime_dir: Path) -> "Optional[str | bool]":
    """The pid the lock file names when no process holds it; False when one does; None: cannot tell."""
    try:
        fd = os.open(lock_path(runtime_dir), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        # A daemon makes a regular file; anything else there (in a dir someone else made) says nothing.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            if lock_file.held(fd):
                return False  # a daemon serves it, perhaps stopped (the request's timeout tells)
            words = os.pread(fd, 32, 0).decode(errors="replace").split()
            # Read between two queries: a daemon that locked and wrote the file meanwhile is seen by the second.
            if lock_file.held(fd):
                return False
        except OSError:
            return None
        pid = words[0] if words else ""
        if lock_file.OFD_MARK in words[1:]:
            return pid
        return _flock_free(fd, pid)
    finally:
        os.close(fd)


def _flock_free(fd: int, pid: str) -> "Optional[str | bool]":
    """For a file no daemon of this release wrote: what a shared flock says (False: held)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return False if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return pid


def _refused(path: Path) -> bool:
    """True when nothing listens on the AF_UNIX stream socket at ``path``. A daemon that does listen sees
    a connection close before it said anything, which ZeroMQ drops without a word."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    except OSError:
        return False
    try:
        sock.connect(str(path))
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # a full backlog (EAGAIN), no socket file, no permission: nothing certain
    finally:
        sock.close()
    return False
