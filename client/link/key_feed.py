"""The client's end of the daemon's key feed (SPEC.md, section 12): a SUB socket that learns, without a
round trip, which keys of one prefix name a feature, and what descriptor each has.

Every answer is a hint. The feed is lossy (a subscriber that falls behind loses messages; one that is
not yet connected never sees them), and an entry may be stale by the time it is read: a miss means "ask
the daemon", and a hit must be validated against the lease table (get's check, or a hold) before use.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections import OrderedDict
from typing import Optional

import zmq

from mmfeat.protos.descriptor import Descriptor, DescriptorError

from . import fd_budget

log = logging.getLogger("mmfeat.client")

# The daemon answers a subscription to a topic that starts with this (no key does) with that topic:
# proof that what this socket subscribed to before it is in place (daemon/sockets/key_feed.py).
PROBE_PREFIX = b"~"
# A key (256 bytes at most) and a kept descriptor (2048 at most): a larger frame is no feed message.
_MAX_MESSAGE_BYTES = 4096
# Messages one find() reads at most before it answers: a feed faster than this reader must not keep it
# in the loop for good (what is left waits for the next find).
_MAX_DRAIN = 1 << 17
_FOLLOW_POLL_MS = 100  # the feed's thread asks the socket at least this often
_JOIN_S = 2.0


def check_prefix(prefix: object) -> Optional[str]:
    """``prefix`` as Client(key_feed=) takes it: None, or a str of keys' leading characters."""
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"key_feed must be None or the str prefix of the keys to follow, not {prefix!r}")
    return prefix


class KeyFeed:
    """The keys under ``prefix`` the daemon at ``endpoint`` bound, with their descriptors, at most
    ``max_entries`` of them (the oldest go first). Safe to share between threads; in a forked child it
    answers None and never touches the parent's socket (the child's Client opens a session, and a feed,
    of its own)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, prefix: str, max_entries: int = 65536) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries!r}")
        self.endpoint = endpoint
        self.prefix = prefix
        self.max_entries = max_entries
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()  # a ZeroMQ socket is one thread's at a time
        self._pid = os.getpid()
        self._probe = PROBE_PREFIX + b"probe/" + os.urandom(8).hex().encode()
        self._ready = False
        fd_budget.ensure(fd_budget.ZMQ_SOCKET_FDS, "the key feed of mmfeatd")
        sock = ctx.socket(zmq.SUB)
        try:
            sock.linger = 0
            # The feed drops what a full queue cannot take: as deep as the daemon's, so that a burst of
            # binds between two finds costs no keys.
            sock.rcvhwm = max_entries
            sock.maxmsgsize = _MAX_MESSAGE_BYTES
            sock.setsockopt(zmq.SUBSCRIBE, prefix.encode())
            sock.setsockopt(zmq.SUBSCRIBE, self._probe)  # after the prefix: its answer says both are in place
            sock.connect(endpoint)
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock: Optional[zmq.Socket] = sock
        # A thread reads the feed as it comes, so that a find usually has nothing left to read (a find
        # reads what it has not, under the same lock: a ZeroMQ socket is one thread's at a time). It
        # waits on the socket's fd, which any thread may poll, not on the socket.
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = threading.Thread(
            target=self._follow, args=(sock.getsockopt(zmq.FD),), name="mmfeat-key-feed", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait, ``timeout`` seconds at most, until the daemon has this socket's subscription in place, so
        that every key bound from then on reaches it (unless it falls behind). Whether it has."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._pid != os.getpid() or self._sock is None:
                    return False
                self._drain()
                if self._ready:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._sock.poll(min(left, 0.05) * 1000)

    def find(self, key: str) -> Optional[bytes]:
        """The descriptor bytes of the feature the feed last said ``key`` names, or None: a hint, to be
        validated before use (see the module's docstring)."""
        if self._pid != os.getpid():
            return None  # the parent's socket and lock: not ours to touch
        with self._lock:
            if self._sock is None:
                return None
            # What the feed's thread took in first; the socket only for a key not there yet (a bind
            # just published): a key there that a newer message rebinds is validated by its caller.
            entry = self._entries.get(key)
            if entry is None:
                self._drain()
                entry = self._entries.get(key)
            return entry

    def wait_for(self, keys: list[str], timeout: float) -> bool:
        """Wait, ``timeout`` seconds at most, until the feed has brought every one of ``keys``; whether it
        has. For keys known to be on their way (their producer said it saved them)."""
        if self._pid != os.getpid():
            return False
        deadline = time.monotonic() + timeout
        with self._lock:  # the feed's thread waits meanwhile: this thread reads the socket
            while True:
                if self._sock is None:
                    return False
                self._drain()
                if all(k in self._entries for k in keys):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._sock.poll(max(1, int(left * 1000)))

    def __len__(self) -> int:
        return len(self._entries)

    def _drain(self) -> None:
        # Called with the lock held.
        sock, entries = self._sock, self._entries
        assert sock is not None
        events = sock.getsockopt
        for _ in range(_MAX_DRAIN):
            # Asked first: the usual find has nothing waiting, and a recv that raises Again costs more.
            if not events(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            topic, descriptor = frames
            if topic.startswith(PROBE_PREFIX):
                if topic == self._probe and not self._ready:
                    self._ready = True
                    sock.setsockopt(zmq.UNSUBSCRIBE, self._probe)
                continue
            try:
                key = topic.decode()
            except UnicodeDecodeError:
                continue
            entries.pop(key, None)  # a key bound again goes last: it is the newest
            if descriptor and threading.current_thread() is self._thread:
                # Parsed here, off the scheduler's path: its hold_many finds the parse in from_bytes' cache.
                try:
                    Descriptor.from_bytes(descriptor)
                except DescriptorError:
                    pass  # refused where it is used
            if descriptor:
                entries[key] = descriptor
                if len(entries) > self.max_entries:
                    entries.popitem(last=False)

    def _follow(self, fd: int) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not self._stop.is_set():
            # The fd signals edges only: a find that read the socket meanwhile may leave no edge for the
            # next message, so the wait is bounded and the socket asked each time.
            poller.poll(_FOLLOW_POLL_MS)
            with self._lock:
                if self._sock is None or self._stop.is_set():
                    return
                try:
                    self._drain()
                except zmq.ZMQError:
                    return  # closed under it: finds read nothing more either

    def close(self) -> None:
        if self._pid != os.getpid():
            self._sock = None  # the parent's: dropped here, closed there (its thread is not in this process)
            self._thread = None
            self._entries = OrderedDict()
            return
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)  # within one poll of the fd: it looks at the flag after each
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
            self._entries.clear()
