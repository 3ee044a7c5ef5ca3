"""The control socket: a ZeroMQ ROUTER on our own listening socket, with its connections counted and
capped, and a reset for when what peers queue in it grows past the memory budget.

The connections are counted and capped by a ConnectionCap (libzmq aborts on EMFILE in accept and has
no limit of its own). The cap sits at half the fd limit, so a burst has the other half to outrun its
thread. libzmq has no limit either on the frames of a message that never ends (they pile up until the
last one arrives): when the daemon's anonymous memory outgrows its budget, the ROUTER is replaced by a
fresh one, every connection and whatever it queued is dropped, and clients reconnect on their own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import zmq

from mmfeat.protos.codec import MAX_IN_FLIGHT

from .capped_listener import CappedListener
from .connection_cap import ConnectionCap, IsOurs

log = logging.getLogger("mmfeatd")

# Frames between the request limit and this get a TOO_LARGE reply; beyond it ZMQ drops the peer.
HARD_FRAME_LIMIT = 256 << 10
# Per peer, in replies. No reply to a peer within MAX_IN_FLIGHT may be dropped, and libzmq's count of
# what a peer's pipe holds trails what its I/O thread took out by up to half the mark (the reader
# reports in batches of the low-water mark, hwm/2), so N replies in flight can look like N + hwm/2 - 1:
# four times the limit keeps that under the mark with a limit's worth to spare for reports not yet
# processed. A peer past the limit that never reads loses replies instead of growing the daemon.
SEND_HWM = 4 * MAX_IN_FLIGHT
RECV_HWM = 1024
# Replies queued in ZMQ's I/O thread when the loop ends (the ack that finished a drain) still go out.
REPLY_LINGER_MS = 500


class ControlSocket(CappedListener):
    def __init__(self, ctx: zmq.Context, path: Path, endpoint: str, mode: int, max_connections: int, is_ours: IsOurs,
                 on_accept: Optional[Callable[[], None]] = None) -> None:
        self.resets = 0
        cap = ConnectionCap(ctx, "control socket", max_connections, is_ours,
                            "Raise LimitNOFILE and max_connections, or find the process that opens them",
                            on_accept=on_accept)
        super().__init__(ctx, zmq.ROUTER, path, endpoint, mode, cap)

    @property
    def router(self) -> Optional[zmq.Socket]:
        return self.sock

    def _configure(self, router: zmq.Socket) -> None:
        router.maxmsgsize = HARD_FRAME_LIMIT
        router.sndhwm, router.rcvhwm = SEND_HWM, RECV_HWM
        # A reply past the mark raises zmq.Again instead of vanishing, so that the loop counts it.
        router.router_mandatory = 1

    def reset(self, why: str) -> None:
        """Drop every connection and what it queued, and listen again on a fresh socket."""
        self.resets += 1
        log.warning("control socket reset: %s; every client reconnects and repeats the request in flight", why)
        self._replace()

    def close(self, linger: int = REPLY_LINGER_MS) -> None:
        super().close(linger)
