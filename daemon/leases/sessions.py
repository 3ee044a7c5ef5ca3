"""Client sessions: a hello on the control socket opens one; its fd-channel connection keeps it alive.

The fd connection's EOF is how the daemon learns a process died, so a session may reserve only once
that connection is attached, and its RESERVED leases are reclaimed when it closes.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from mmfeat.protos.messages import TOKEN_BYTES

# A hello whose fd connection has not arrived by then is dropped (the client died between the two).
ATTACH_GRACE_S = 30.0
# Sessions waiting for their fd channel at most. A hello beyond it drops the oldest waiting one: a live
# client attaches within milliseconds of its hello, so the oldest are dead or a flood, and refusing the
# newest instead would lock every client out for ATTACH_GRACE_S.
MAX_PENDING_SESSIONS = 4096
# Sessions cut (daemon/core.py) remembered at most, so that their next request is told why.
MAX_CUT_REMEMBERED = 1024


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()  # primary and supplementary gids at connect time


@dataclass
class Session:
    token: bytes
    name: str
    pid: int
    created: float
    peer: Optional[PeerCred] = None
    refused: int = 0  # table words refused in slots the session holds, charged to it

    @property
    def attached(self) -> bool:
        return self.peer is not None

    @property
    def node_pid(self) -> int:
        """The pid to name it by: once attached, the kernel's for its fd channel (SO_PEERCRED, translated
        into the daemon's PID namespace); before, the one its hello named, which is only the client's word
        (its own namespace's pid in a container, anything at all from a hostile client)."""
        return self.peer.pid if self.peer is not None else self.pid


class SessionTable:
    """Sessions waiting for their fd channel (oldest first) and attached ones, each O(1) to count."""

    def __init__(self) -> None:
        # Ordered dicts where the oldest leaves again and again (a hello flood, a stream of cuts): a plain
        # dict that loses its first key keeps dummies at its front, which every look at its oldest walks.
        self._pending: OrderedDict[bytes, Session] = OrderedDict()  # creation order
        self._attached: dict[bytes, Session] = {}
        self._cut: OrderedDict[bytes, None] = OrderedDict()  # tokens of the sessions cut lately, oldest first

    def __len__(self) -> int:
        return len(self._pending) + len(self._attached)

    def open(self, name: str, pid: int, now: float) -> tuple[Session, list[Session]]:
        """A new session, and the waiting ones dropped to make room for it."""
        dropped = []
        while len(self._pending) >= MAX_PENDING_SESSIONS:
            dropped.append(self._pending.popitem(last=False)[1])
        session = Session(secrets.token_bytes(TOKEN_BYTES), name, pid, now)
        self._pending[session.token] = session
        return session, dropped

    def get(self, token: bytes) -> Optional[Session]:
        return self._attached.get(token) or self._pending.get(token)

    def attach(self, token: bytes, peer: PeerCred) -> None:
        session = self._pending.pop(token)
        session.peer = peer
        self._attached[token] = session

    def close(self, token: bytes) -> Optional[Session]:
        return self._attached.pop(token, None) or self._pending.pop(token, None)

    def cut(self, token: bytes) -> Optional[Session]:
        """Close the session and remember, for a while, that it was cut."""
        self._cut[token] = None
        while len(self._cut) > MAX_CUT_REMEMBERED:
            self._cut.popitem(last=False)
        return self.close(token)

    def was_cut(self, token: bytes) -> bool:
        return token in self._cut

    def drop_unattached_before(self, cutoff: float) -> int:
        """Drop the sessions created before ``cutoff`` that never attached; how many."""
        n = 0
        while self._pending:
            token, session = next(iter(self._pending.items()))
            if session.created >= cutoff:
                break
            del self._pending[token]
            n += 1
        return n

    def attached_count(self) -> int:
        return len(self._attached)

    def pending_count(self) -> int:
        return len(self._pending)
