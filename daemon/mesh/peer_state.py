"""A peer as the mesh knows it (its socket, what it announced, its liveness), and as stats shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from mmfeat.protos.mesh import MeshHello

from ..config import Peer
from .liveness import NO_KEY, Liveness
from .membership import Listed


@dataclass
class PeerState:
    config: Peer
    dealer: zmq.Socket
    monitor: Optional[zmq.Socket] = None  # the DEALER's handshake events
    source: str = "static"  # the peers_from that listed it
    listed_as: str = ""  # what its source calls it: the endpoint (static), address (dns), file name (dir)
    live: Liveness = field(default_factory=Liveness)
    hello: Optional[MeshHello] = None
    seq: int = 0
    sent_at: dict[int, float] = field(default_factory=dict)
    rtt_s: Optional[float] = None
    messages: int = 0
    auth_failures: int = 0  # handshakes the peer refused our key in
    retry_at: float = 0.0  # when to connect again after a refusal; 0: not waiting to
    conflict: Optional[str] = None  # the node id it announced, when that is ours: nothing it says counts
    logged: set[str] = field(default_factory=set)  # problems logged already, so each is logged once
    # Requests (connection to answer on, frame) that came before its hello, in order: handled once it
    # says who it is now (its epoch decides what they void), dropped if it is forgotten first.
    early: list[tuple[bytes, bytes]] = field(default_factory=list)
    early_bytes: int = 0

    @property
    def state(self) -> str:
        return self.live.state

    @property
    def last_seen(self) -> float:
        return self.live.last_seen

    @property
    def name(self) -> str:
        return self.hello.node if self.hello else self.listed_as or self.config.endpoint


def peer_row(p: PeerState, now: float) -> dict[str, Any]:
    hello = p.hello
    return {
        "endpoint": p.config.endpoint,
        "public_key": p.config.public_key,
        "source": p.source,
        "listed_as": p.listed_as,
        "state": p.state,
        "changed_s_ago": round(now - p.live.changed_at, 3),
        "misses": p.live.misses,
        "auth_failures": p.auth_failures,
        "node": hello.node if hello else None,
        "epoch": hello.epoch if hello else None,
        "pools": [pool.model_dump(exclude={"fabric", "addr"}) | {"fabric": pool.fabric is not None,
                                                                 "pullable": pool.addr != 0}
                  for pool in hello.pools] if hello else [],
        "fabric_domain": hello.fabric_domain.model_dump() if hello and hello.fabric_domain else None,
        "rtt_ms": round(p.rtt_s * 1e3, 3) if p.rtt_s is not None else None,
        "last_seen_s": round(now - p.last_seen, 3) if p.last_seen else None,
    }


def unkeyed_row(entry: Listed, source: str) -> dict[str, Any]:
    return {"endpoint": entry.endpoint, "public_key": None, "source": source, "listed_as": entry.name,
            "state": NO_KEY, "changed_s_ago": None, "misses": 0, "auth_failures": 0, "node": None, "epoch": None,
            "pools": [], "fabric_domain": None, "rtt_ms": None, "last_seen_s": None}
