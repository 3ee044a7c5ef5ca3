"""The key feed: every key the daemon binds or unbinds, published to whoever subscribes (SPEC.md, section 12).

A scheduler learns which keyed features exist without a round trip. The feed is a hint and it is lossy:
a subscriber that falls behind loses messages (a send never waits for it), and one that misses a key
asks the daemon. It listens beside the control socket, with its file mode and a connection cap of its
own (CappedListener), since libzmq aborts on EMFILE however the connections come.

It is an XPUB in manual mode, so that no subscriber decides what the daemon stores: libzmq keeps each
subscribed prefix in a trie for the connection's life, and a peer sending millions of distinct prefixes
would grow it without bound. Here every connection that subscribes to anything is subscribed to
everything (one trie entry per connection, which the cap bounds), and its own SUB drops what it did
not ask for. A subscription to a probe topic (a prefix no key has) is also answered with that topic:
what the subscriber waits for, to know its subscription is in place before it relies on the feed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import zmq

from mmfeat.protos.paths import KEY_FEED_SOCKET, key_feed_endpoint

from .capped_listener import CappedListener
from .connection_cap import ConnectionCap, IsOurs

log = logging.getLogger("mmfeatd")

# Messages queued per subscriber before the feed drops that subscriber's messages: bursts of binds while
# a scheduler is busy must not cost it keys, and past this it asks the daemon instead.
SEND_HWM = 65536
# Subscription messages queued per connection; a peer past it waits (its own I/O thread queues them).
RECV_HWM = 256
# A subscription frame is a byte and a topic: a key prefix (a key is at most 256 bytes) or a probe.
MAX_SUBSCRIPTION_BYTES = 512
# Keys start with a hex namespace: a topic starting with this names no key.
PROBE_PREFIX = b"~"
_SUBSCRIBE = 1
# Subscription messages handled per wake-up, so that a peer flooding them cannot hold the loop.
_BATCH = 256
_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)


class KeyFeed(CappedListener):
    def __init__(self, ctx: zmq.Context, path: Path, endpoint: str, mode: int, max_connections: int,
                 is_ours: IsOurs) -> None:
        self.resets = 0
        self.dropped = 0  # messages no subscriber got because the socket refused them (not per subscriber)
        cap = ConnectionCap(ctx, "key feed", max_connections, is_ours,
                            "Raise LimitNOFILE, or find the process that opens them (schedulers open one each)")
        super().__init__(ctx, zmq.XPUB, path, endpoint, mode, cap)

    def _configure(self, sock: zmq.Socket) -> None:
        sock.sndhwm, sock.rcvhwm = SEND_HWM, RECV_HWM
        sock.maxmsgsize = MAX_SUBSCRIPTION_BYTES
        sock.setsockopt(zmq.XPUB_MANUAL, 1)  # see the module's docstring

    def publish(self, key: str, descriptor: bytes) -> None:
        """``key`` names the feature ``descriptor`` describes from now on; ``b""``: it names none any more.
        Called by KeyIndex on the loop's thread, which owns the socket."""
        self._send(key.encode(), descriptor)

    def _send(self, topic: bytes, body: bytes) -> None:
        if self.sock is None:
            return
        try:
            # An XPUB drops a message for a subscriber past its mark, whole, and never blocks.
            self.sock.send(topic, _MORE_NOBLOCK)
            self.sock.send(body, _NOBLOCK)
        except zmq.ZMQError:
            self.dropped += 1

    def on_events(self) -> None:
        """Handle what subscribers sent: subscriptions, and the probes among them."""
        sock = self.sock
        if sock is None:
            return
        for _ in range(_BATCH):
            try:
                frame = sock.recv(_NOBLOCK)
            except zmq.Again:
                return
            if not frame or frame[0] != _SUBSCRIBE:
                continue  # an unsubscription: the connection stays subscribed until it closes
            # Manual mode: this applies to the connection the frame came from.
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            topic = frame[1:]
            if topic.startswith(PROBE_PREFIX):
                # Its subscriptions came before the probe on the same connection: they are in place.
                self._send(topic, b"")

    def reset(self) -> None:
        """Drop every subscriber and what was queued for it (the memory guard's, with the control
        socket's); each reconnects by itself, and until then asks the daemon."""
        self.resets += 1
        log.warning("key feed reset: every subscriber reconnects, and asks the daemon for what it missed")
        self._replace()


def open_key_feed(ctx: zmq.Context, runtime_dir: Path, mode: int, max_connections: int,
                  is_ours: IsOurs) -> Optional[KeyFeed]:
    """The feed of ``runtime_dir``, or None (logged) where it cannot listen: the daemon serves all the same,
    hello names no feed, and schedulers ask for every key."""
    path = runtime_dir / KEY_FEED_SOCKET
    try:
        return KeyFeed(ctx, path, key_feed_endpoint(runtime_dir), mode, max_connections, is_ours)
    except (OSError, zmq.ZMQError) as exc:
        log.warning("key feed: cannot listen at %s (%s); serving without it, and hello names no feed", path, exc)
        return None
