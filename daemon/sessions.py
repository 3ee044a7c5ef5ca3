"""Client sessions: a hello on the control socket opens one; its fd-channel connection keeps it alive.

The fd connection's EOF is how the daemon learns a process died, so a session may reserve only once
that connection is attached, and its RESERVED leases are reclaimed when it closes.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional

from mmfeat.protos.messages import TOKEN_BYTES

# A hello whose fd connection has not arrived by then is dropped (the client died between the two).
ATTACH_GRACE_S = 30.0
# Sessions waiting for their fd channel at most; a hello beyond it is refused, so a client that only
# says hello cannot grow the table without bound.
MAX_PENDING_SESSIONS = 4096


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


@dataclass
class Session:
    token: bytes
    name: str
    pid: int
    created: float
    peer: Optional[PeerCred] = None

    @property
    def attached(self) -> bool:
        return self.peer is not None


class SessionTable:
    def __init__(self) -> None:
        self._sessions: dict[bytes, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, name: str, pid: int, now: float) -> Session:
        session = Session(secrets.token_bytes(TOKEN_BYTES), name, pid, now)
        self._sessions[session.token] = session
        return session

    def get(self, token: bytes) -> Optional[Session]:
        return self._sessions.get(token)

    def close(self, token: bytes) -> Optional[Session]:
        return self._sessions.pop(token, None)

    def unattached_older_than(self, cutoff: float) -> list[bytes]:
        return [t for t, s in self._sessions.items() if not s.attached and s.created < cutoff]

    def attached_count(self) -> int:
        return sum(1 for s in self._sessions.values() if s.attached)

    def pending_count(self) -> int:
        return len(self._sessions) - self.attached_count()
