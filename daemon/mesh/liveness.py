"""A peer's liveness, with hysteresis: probed from the moment it is listed, used once it answers, left
alone after ``miss_limit`` unanswered probes in a row but probed on, forgotten after ``forget_after_s``.

- ``joining``: listed, not heard from yet (or heard from before it was forgotten); probed.
- ``up``: it answers; once its hello came, pulls and relayed acks go to it.
- ``missing``: ``miss_limit`` probes in a row went unanswered. Nothing goes to it and what waited on it
  failed, but who it was (its hello: node, epoch, pools) is kept: if it answers again with the same
  epoch it is up again at once, its features as readable as before.
- ``gone``: missing for ``forget_after_s``, or no longer listed by its source (which ends its
  connections at once: a revoked key). Its hello is dropped: if it answers again it is a new peer that
  says hello again. A peer its source still lists is probed on; one it no longer lists leaves stats
  ``forget_after_s`` later.

A miss is counted when a probe goes out and nothing at all was heard from the peer since the one before
it: a daemon that was itself stopped or slow sends fewer probes and so counts no misses for that time,
and reads what waited in its sockets before it probes again.

Besides these, a peer may be ``auth_failed`` (its listener refused this node's key), ``node_id_conflict``
(it announces this node's own node id) or ``no_key`` (listed without a key: nothing connects to it);
daemon/mesh/peers.py sets those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import Settings

JOINING, UP, MISSING, GONE = "joining", "up", "missing", "gone"
AUTH_FAILED, NODE_ID_CONFLICT, NO_KEY = "auth_failed", "node_id_conflict", "no_key"
STATES = (JOINING, UP, MISSING, GONE, AUTH_FAILED, NODE_ID_CONFLICT, NO_KEY)


@dataclass(frozen=True)
class Cadence:
    probe_interval_s: float
    miss_limit: int
    forget_after_s: float

    @classmethod
    def of(cls, settings: Settings) -> "Cadence":
        return cls(settings.probe_interval_s, settings.miss_limit, settings.forget_after_s)

    @property
    def missing_after_s(self) -> float:
        """How long a silent peer stays up, at the most, while this daemon probes on time."""
        return self.probe_interval_s * (self.miss_limit + 1)


@dataclass
class Liveness:
    state: str = JOINING
    changed_at: float = 0.0  # when ``state`` last changed
    last_seen: float = 0.0  # when anything valid was last heard from the peer; 0: never
    last_probe: float = 0.0  # when the last probe went out
    next_probe: float = 0.0  # 0: at the next tick, as soon as the peer is listed
    misses: int = 0  # probes in a row that nothing was heard after

    def set(self, state: str, now: float) -> bool:
        """Change the state; False if it was that already."""
        if state == self.state:
            return False
        self.state, self.changed_at = state, now
        return True

    def heard(self, now: float) -> Optional[str]:
        """Something valid came from the peer. Returns the state it leaves for ``up``, if it changes."""
        self.last_seen = now
        self.misses = 0
        before = self.state
        if before in (JOINING, MISSING, GONE, AUTH_FAILED) and self.set(UP, now):
            return before
        return None

    def probe(self, now: float, cadence: Cadence) -> bool:
        """True when a probe is due now (and counts as sent); a miss is counted first if nothing was
        heard since the previous probe."""
        if now < self.next_probe:
            return False
        if self.last_probe and self.last_seen < self.last_probe:
            self.misses += 1
        self.last_probe = now
        self.next_probe = now + cadence.probe_interval_s
        return True

    def due(self, now: float, cadence: Cadence) -> Optional[str]:
        """The state the peer should be in now, if misses or time changed it: ``missing`` or ``gone``."""
        if self.state == UP and self.misses >= cadence.miss_limit:
            return MISSING
        if self.state == MISSING and now - self.changed_at >= cadence.forget_after_s:
            return GONE
        return None
