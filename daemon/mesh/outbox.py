"""What this daemon tells each peer about features, batched: one message per kind per peer per
ACK_BATCH_S, not one per feature.

- ``pulled``: features of the peer's that this node pulled (the owner then says when each ends);
- ``acks``: consumers' acks of the peer's features, whose waiting senders get the owner's answers;
- ``ended``: features of ours that the peer pulled and that are now gone, so it frees its copies.

Within a flush, ``pulled`` goes before ``acks``: an ack may end a feature, and the owner must know by
then who holds a copy of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.mesh import MAX_MESH_BATCH, MeshAck
from mmfeat.protos.messages import AckReply

from .peers import Mesh, PeerState

ACK_BATCH_S = 0.002
# An acks batch whose answer takes longer than this means the owner is gone.
ANSWER_TIMEOUT_S = 30.0

Respond = Callable[[Any], None]  # called once with a reply (protos.messages) or an MmfeatError


@dataclass
class PeerCounters:
    pulls: int = 0
    bytes_pulled: int = 0
    pull_failures: int = 0
    shared_gets: int = 0  # gets served from a copy pulled (or being pulled) for another get
    checks_served: int = 0
    bytes_served: int = 0
    acks_relayed: int = 0
    acks_received: int = 0
    acks_dropped: int = 0
    ended_sent: int = 0
    fabric_fallbacks: int = 0  # gets pulled because the client could not import the FABRIC handle

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Box:
    pulled: list[dict[str, Any]] = field(default_factory=list)
    acks: list[tuple[MeshAck, Optional[Respond]]] = field(default_factory=list)
    ended: list[list[int]] = field(default_factory=list)


class MeshOutbox:
    def __init__(self, mesh: Mesh, epoch: int, counters: Callable[[str], PeerCounters]) -> None:
        self._mesh = mesh
        self._epoch = epoch  # this daemon's, which ``ended`` names
        self._counters = counters
        self._boxes: dict[str, _Box] = {}
        self._waiting: dict[tuple[str, int], tuple[float, list[Optional[Respond]]]] = {}  # acks batches sent
        self._batch_ids = itertools.count(1)
        self.next_flush = float("inf")  # when the loop should call flush() next

    def pulled(self, peer: str, lease: dict[str, Any], now: float) -> None:
        self._box(peer, now).pulled.append(lease)

    def ended(self, peer: str, lease_id: int, gen: int, now: float) -> None:
        self._box(peer, now).ended.append([lease_id, gen])

    def ack(self, peer: str, ack: MeshAck, respond: Optional[Respond], now: float) -> None:
        """``respond`` gets the owner's answer for this ack, or why there will be none."""
        box = self._box(peer, now)
        box.acks.append((ack, respond))
        if len(box.acks) >= MAX_MESH_BATCH:
            self._flush_peer(peer, box, now)

    def flush(self, now: float) -> None:
        """Send what waited for its batch; the loop calls this once ``next_flush`` has passed."""
        for key, box in list(self._boxes.items()):
            self._flush_peer(key, box, now)
        self._boxes.clear()
        self.next_flush = float("inf")

    def on_acked(self, peer: PeerState, batch: int, results: list[Any]) -> None:
        entry = self._waiting.pop((peer.config.public_key, batch), None)
        if entry is None:  # not ours, answered already, or timed out
            return
        for respond, result in zip(entry[1], results):
            if respond is not None:
                respond(peer_error(result.code, result.message, peer) if result.code else
                        AckReply(result.remaining, result.freed, result.over_acked))

    def drop_peer(self, peer: str, error: MmfeatError) -> None:
        """The peer went down or restarted: nothing more goes to it, and whoever waits hears ``error``.
        Acks still in its box were for the epoch that is gone: dropped and counted, never sent on to the
        new one (which would refuse them as stale anyway), and a waiting one is answered now."""
        box = self._boxes.pop(peer, None)
        if box is not None and box.acks:
            self._counters(peer).acks_dropped += sum(a.count for a, _ in box.acks)
            for _, respond in box.acks:
                if respond is not None:
                    respond(error)
        for key in [k for k in self._waiting if k[0] == peer]:
            for respond in self._waiting.pop(key)[1]:
                if respond is not None:
                    respond(error)

    def tick(self, now: float, late: MmfeatError) -> None:
        for key, (deadline, responders) in list(self._waiting.items()):
            if now > deadline:
                del self._waiting[key]
                for respond in responders:
                    if respond is not None:
                        respond(late)

    def _box(self, peer: str, now: float) -> _Box:
        self.next_flush = min(self.next_flush, now + ACK_BATCH_S)
        return self._boxes.setdefault(peer, _Box())

    def _flush_peer(self, key: str, box: _Box, now: float) -> None:
        peer = self._mesh.peers.get(key)
        counters = self._counters(key)
        while box.pulled:
            chunk, box.pulled = box.pulled[:MAX_MESH_BATCH], box.pulled[MAX_MESH_BATCH:]
            if peer is not None:
                self._mesh.send(peer, "pulled", {"leases": chunk})  # lost: the copy then lives until ack_ttl
        while box.acks:
            chunk, box.acks = box.acks[:MAX_MESH_BATCH], box.acks[MAX_MESH_BATCH:]
            batch = next(self._batch_ids)
            body = {"batch": batch, "acks": [a.model_dump() for a, _ in chunk]}
            if peer is None or peer.state != "up" or not self._mesh.send(peer, "acks", body):
                counters.acks_dropped += sum(a.count for a, _ in chunk)
                for _, respond in chunk:
                    if respond is not None:
                        respond(MmfeatError(ErrorCode.PEER_UNAVAILABLE, "the owner's node is not reachable; its "
                                                                        "ack_ttl frees the feature"))
                continue
            counters.acks_relayed += sum(a.count for a, _ in chunk)
            if any(r is not None for _, r in chunk):
                self._waiting[(key, batch)] = (now + ANSWER_TIMEOUT_S, [r for _, r in chunk])
        while box.ended:
            chunk, box.ended = box.ended[:MAX_MESH_BATCH], box.ended[MAX_MESH_BATCH:]
            if peer is not None and self._mesh.send(peer, "ended", {"epoch": self._epoch, "leases": chunk}):
                counters.ended_sent += len(chunk)


def peer_error(code: str, message: str, peer: PeerState) -> MmfeatError:
    """A peer's error answer as ours, naming the peer; a code we do not know is INTERNAL."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.INTERNAL
    node = peer.hello.node if peer.hello else peer.config.endpoint
    return MmfeatError(ec, f"node {node!r}: {message}")
