"""Pulled copies of other nodes' features, as this daemon keeps them (remote.py pulls and hands them
out), and how a feature in a peer's pool reaches a client here.

A copy is one lease of this daemon's pool per feature per node, however many clients here read it. It
is published as a retained feature of the daemon's own session, so that a client may hold it for its
readers (``remote_get`` with ``hold``, a scheduler's, for the ranks it loads for) exactly as it holds a
retained feature of this node, and lives:
- while any hold on it lives, whatever its deadline or the owner says;
- otherwise until the owner says the feature ended, or ``ack_ttl`` after the last get here was handed
  it (each handout moves its deadline), or, when the owner can no longer say so (down, restarted), once
  consumers here acked as often as gets here were handed it.
A copy only ever held (never handed to a plain get, whose readers read it in place without a hold) is
a cache: the pool may evict it, oldest first, when it needs the space and nothing holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from mmfeat.protos.mesh import MeshFabricDomain, MeshPool
from mmfeat.protos.messages import FabricPool, LeaseRef, LeaseRefReply, RemoteGetReply

from ..leases.lease import Lease
from .outbox import Respond


class Waiter(NamedTuple):
    """A client waiting for a copy (or a FABRIC check): answered by ``deadline`` (time.monotonic())."""

    respond: Respond
    deadline: float
    # (session, readers): answered with a hold over the copy for that many readers, not the copy itself.
    hold: Optional[tuple[bytes, int]] = None


@dataclass
class Copy:
    key: tuple
    peer: str
    node: str
    ref: LeaseRef  # the owner's lease, as the descriptor names it
    job: int  # the pull's
    local: Lease
    state: str = "pulling"  # pulling, checking, ready; failed while a pull it gave up on still runs
    verified: bool = False  # the pull READs the owner's lease table too: no check message to wait for
    waiters: list[Waiter] = field(default_factory=list)
    deadline: float = 0.0
    handed: int = 0  # plain gets here answered with this copy (holds are not counted: they end themselves)
    acked: int = 0  # acks of the feature by consumers here
    plain: bool = False  # handed to a plain get: never evicted from then on


@dataclass
class Check:
    peer: str
    copy: Optional[Copy]  # None on the FABRIC route, where nothing is copied
    waiters: list[Waiter]
    pool: Optional[MeshPool]
    ref: LeaseRef
    deadline: float


def route(pool: MeshPool, local: Optional[MeshFabricDomain], peer: Optional[MeshFabricDomain],
          pull: bool = False) -> str:
    """How a feature in a peer's ``pool`` reaches a client here: "fabric" (the client maps the owner's
    memory through the relayed FABRIC handle) or "pull" (NIXL copies it into this node's pool).
    ``local``/``peer``: the NVLink domains this node and the owner announce; a FABRIC handle imports only
    within one cluster UUID and clique, so anything else is pulled. ``pull``: the client's import of the
    handle failed (no IMEX channel in its container, say), or it wants a copy here to hold, so it asks
    for the bytes instead."""
    if (not pull and pool.kind == "cuda" and pool.handle == "fabric" and pool.fabric is not None
            and local is not None and peer == local):
        return "fabric"
    return "pull"


def copy_pool(pullable: dict[int, Any], into_pool: Optional[int]) -> int:
    """The pool of this daemon's that a pulled copy goes to: the client's choice (the pool on its GPU)
    when that pool can take pulls, else the first that can. ``pullable``: pool id -> its registration."""
    return into_pool if into_pool is not None and into_pool in pullable else next(iter(pullable))


def fabric_reply(node: str, epoch: int, pool: MeshPool, ref: LeaseRef) -> RemoteGetReply:
    """remote_get's answer on the FABRIC route: the owner's pool as a client maps a FABRIC pool of its own
    daemon (client/gpu/cuda_import.py reads ``handle``, ``fabric``, ``size``, ``pool`` and ``epoch``), and the
    owner's lease to read in it."""
    return RemoteGetReply(lease_ref_reply(ref), FabricPool(node, epoch, pool.pool, pool.size, pool.device, "fabric",
                                                           pool.fabric))


def lease_ref_reply(ref: LeaseRef) -> LeaseRefReply:
    return LeaseRefReply(ref.pool, ref.epoch, ref.lease, ref.gen, ref.token, ref.offset, ref.nbytes)
