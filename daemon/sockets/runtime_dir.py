"""The runtime directory: checked before use, locked for the daemon's lifetime, sockets made safely.

Another user must not be able to squat the directory (and serve clients from a fake daemon), a
second daemon must not start on it while the first lives (even stopped), and a daemon must never
remove socket files it did not make. So: the directory must belong to the daemon's user and be
writable by nobody else; an exclusive lock on ``mmfeatd.lock`` lasts as long as the process; socket
files are created with the right mode by the umask (a chmod after bind would follow a swapped
symlink), and each is unlinked only while it is still the inode this daemon bound.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
from pathlib import Path
from typing import Iterator, Optional

from mmfeat.protos import lock_file
from mmfeat.protos.paths import LOCK_FILE

# The daemon's lock is an OFD record lock, which clients query without taking anything, and a flock,
# which clients of earlier releases (and, where the file was left by an earlier daemon, of this one)
# take shared for an instant to learn whether a daemon holds it: a daemon whose flock meets such a
# probe waits this long before it concludes that another daemon holds it.
# The file stays 0600: any process that can open it can lock it, and so keep every later daemon out.
_PROBE_GRACE_S = 0.5
_PROBE_RETRY_S = 0.005


class RuntimeDirError(Exception):
    """The runtime directory cannot be used safely; the message says why and what to do."""


def check_owned_dir(path: Path) -> os.stat_result:
    """lstat ``path`` and refuse it unless it is a real directory of ours that no one else may write."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RuntimeDirError(f"runtime_dir {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeDirError(f"runtime_dir {path} is a symlink, and a symlink is refused (it could be swapped); "
                              "remove it or choose another")
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime_dir {path} is not a directory; remove it or choose another")
    if st.st_uid != os.geteuid():
        raise RuntimeDirError(
            f"runtime_dir {path} belongs to uid {st.st_uid}, not to this daemon's uid {os.geteuid()}: another user may "
            "have made it to serve clients from a fake daemon; remove it or set runtime_dir to a directory of ours"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeDirError(
            f"runtime_dir {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may write it and replace the sockets; "
            "chmod go-w it (0750 is the default)"
        )
    return st


class RuntimeDir:
    """A checked runtime directory and the lock that makes this daemon its only server."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: Optional[int] = None
        self._old_lock_fd: Optional[int] = None  # a lock file others could open, replaced (see acquire)

    def acquire(self) -> None:
        """Create (0750) and check the directory, then take the lock; RuntimeDirError if either fails."""
        try:
            self.path.mkdir(mode=0o750, parents=True, exist_ok=True)
        except FileExistsError:
            pass  # something that is not a directory has the name: the check below says so, not "File exists"
        except OSError as exc:
            raise RuntimeDirError(f"cannot create runtime_dir {self.path}: {exc.strerror}") from None
        check_owned_dir(self.path)
        lock_path = self.path / LOCK_FILE
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise RuntimeDirError(f"cannot open lock file {lock_path}: {exc.strerror}") from None
        st = os.fstat(fd)
        loose = st.st_uid != os.geteuid() or bool(st.st_mode & 0o077)
        try:
            _lock_exclusive(fd)
        except OSError as exc:
            holder = (os.pread(fd, 32, 0).decode(errors="replace").split() or ["?"])[0]
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                who = f"pid {holder}"
                if loose:
                    who += (f", or another user: the file has mode {stat.S_IMODE(st.st_mode):04o} and uid {st.st_uid}, "
                            "so others may hold it; if no mmfeatd runs, remove it")
                raise RuntimeDirError(
                    f"another mmfeatd ({who}) holds {lock_path}: it is serving {self.path}, perhaps stopped; "
                    "stop it first or choose another runtime_dir"
                ) from None
            raise RuntimeDirError(f"cannot lock {lock_path}: {exc.strerror}") from None
        if loose:
            # Whoever opened it keeps that fd through any chmod and could flock it once this daemon is
            # gone, keeping every later one out: serve from a fresh file that only we ever opened. The
            # old one stays locked too, so a daemon that opened it before the rename finds it held.
            self._old_lock_fd = fd
            fd = _fresh_lock(lock_path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, lock_file.contents(os.getpid()), 0)
        self._lock_fd = fd

    def release(self) -> None:
        # The lock file stays: unlinking it would let a third daemon lock a new inode while a second
        # still waits on the old one.
        for fd in (self._lock_fd, self._old_lock_fd):
            if fd is not None:
                os.close(fd)
        self._lock_fd = self._old_lock_fd = None


def _lock_exclusive(fd: int) -> None:
    """The OFD lock, and flock(LOCK_EX) without blocking on a live daemon but through the momentary
    shared probes of clients that probe with flock. OSError (EAGAIN) if another daemon holds either."""
    lock_file.lock(fd)  # first: clients of this release then see a daemon at once, and take nothing
    deadline = time.monotonic() + _PROBE_GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() >= deadline:
                raise
        time.sleep(_PROBE_RETRY_S)


def _fresh_lock(lock_path: Path) -> int:
    """A new 0600 lock file, locked before it takes ``lock_path``'s name (so it is never seen free)."""
    tmp = lock_path.with_name(f".{lock_path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise RuntimeDirError(f"cannot create a lock file beside {lock_path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is only what the umask leaves of it
        lock_file.lock(fd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, lock_path)
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise RuntimeDirError(f"cannot replace {lock_path}: {exc.strerror}") from None
    return fd


@contextlib.contextmanager
def _umask(mode: int) -> Iterator[None]:
    # Sockets are bound at start, before any thread of ours creates files, so the process-wide umask is safe.
    old = os.umask(0o777 & ~mode)
    try:
        yield
    finally:
        os.umask(old)


class SocketFile:
    """A listening AF_UNIX socket whose file was created with ``mode`` and is unlinked only if still ours."""

    def __init__(self, path: Path, kind: int, mode: int, backlog: int = 128) -> None:
        self.path = path
        # Bound beside it, then renamed over it: the path always names a socket, so a client never finds
        # it missing while a socket is replaced (a dead daemon's leftover, or a control-socket reset).
        # The lock proves that no live daemon serves this dir.
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        self.sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
        try:
            with _umask(mode):
                self.sock.bind(str(tmp))
            self.sock.listen(backlog)
            os.rename(tmp, path)
            st = os.lstat(path)
        except BaseException:
            self.sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._inode = (st.st_dev, st.st_ino)

    def unlink(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            os.unlink(self.path)
