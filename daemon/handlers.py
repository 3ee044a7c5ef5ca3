"""One handler per op, in one explicit table. Each takes the validated request and returns the reply body.

A handler returns its op's reply type (protos/messages.py, REPLY_TYPES) or a Deferred one, and raises
MmfeatError for a refusal; daemon/dispatch.py turns either into a reply frame.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from mmfeat.protos import messages as m
from mmfeat.protos.codec import MAX_REQUEST_BYTES
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.handshake import ArenaGrant

from .core import DaemonCore, Remote
from .leases.sessions import MAX_PENDING_SESSIONS

log = logging.getLogger("mmfeatd")

Reply = m.Reply
Respond = Callable[[Any], None]  # a reply, or the MmfeatError the request ended with


@dataclass(frozen=True)
class Deferred:
    """A reply that waits on another node: dispatch calls ``start`` with where the answer goes (None for
    a quiet request, which wants none). ``start`` may raise MmfeatError before it takes anything on."""

    start: Callable[[Optional[Respond]], None]


def _remote(core: DaemonCore) -> Remote:
    if core.remote is None:
        raise MmfeatError(ErrorCode.FORBIDDEN, "the feature is another node's and this daemon has no mesh: set listen "
                                               "and peers on both nodes to reach other nodes' features")
    return core.remote


def _lease_reply(core: DaemonCore, lease: Any, now: float) -> m.LeaseReply:
    ref = m.LeaseRefReply(lease.pool_id, core.epoch, lease.lease_id, lease.gen, lease.token, lease.offset, lease.nbytes)
    # The lease's own deadline, not the TTL hello reported: a reload changes the TTL of leases granted
    # after it, and the producer must know when this one ends.
    return m.LeaseReply(ref, lease.state.value, lease.consumers, lease.remaining, max(0.0, lease.deadline - now))


def hello(core: DaemonCore, req: m.HelloRequest, now: float) -> m.HelloReply:
    """Open a session; the client then presents ``session`` on the fd channel to receive pool fds."""
    session, dropped = core.sessions.open(req.name, req.pid, now)
    if dropped:
        core.counters.sessions_dropped += len(dropped)
        if now - core.sessions_dropped_logged_at >= 10.0:
            core.sessions_dropped_logged_at = now
            log.warning(
                "%d sessions are waiting for their fd channel: dropped the oldest, from %r (pid %d); a client "
                "that says hello without connecting to the fd socket is flooding or crash-looping (%d dropped so far)",
                MAX_PENDING_SESSIONS, dropped[0].name, dropped[0].pid, core.counters.sessions_dropped,
            )
    return m.HelloReply(
        session=session.token,
        epoch=core.epoch,
        node=core.settings.node_id,
        endpoint=core.endpoint,
        pools=tuple(p.info(core.epoch) for p in core.pools.values()),
        reserve_ttl=core.ledger.reserve_ttl,
        ack_ttl=core.ledger.ack_ttl,
        max_request_bytes=MAX_REQUEST_BYTES,
        table_slots=core.table.slots,
        # Producers may ask for arenas and ack in the lease table (SPEC.md, section 5).
        arenas=core.arenas_enabled,
        # CLOCK_MONOTONIC here: a client on the same kernel sees the same clock and may then send
        # request deadlines (SPEC.md, section 2).
        clock=now,
    )


def reserve(core: DaemonCore, req: m.ReserveRequest, now: float) -> m.LeaseReply:
    """Allocate a slice for ``nbytes`` that ``consumers`` consumers will acknowledge."""
    if core.draining:
        raise MmfeatError(ErrorCode.DRAINING, "the daemon is shutting down; send this feature inline")
    # Acks clients wrote since the last sweep may have freed the range this needs. First: a sweep may
    # cut this very session (SPEC.md, section 9). What it leaves unadopted (as the arena op's does)
    # holds no range this could take: an arena's space is its arena's.
    core.sweep(now, defer_unacked=True)
    session = core.sessions.get(req.session)
    if session is None:
        core.check_not_cut(req.session)
        raise MmfeatError(ErrorCode.NOT_FOUND, "unknown session (expired, or from before a daemon restart): reconnect")
    if not session.attached:
        raise MmfeatError(ErrorCode.BAD_STATE, "connect the fd channel before reserving, so a crash frees your leases")
    pool_id = core.pool_for(req.device)
    t0 = time.perf_counter()
    lease = core.ledger.reserve(req.session, pool_id, req.nbytes, req.consumers, now)
    if core.observe_reserve is not None:
        core.observe_reserve(time.perf_counter() - t0)
    return _lease_reply(core, lease, now)


def arena(core: DaemonCore, req: m.ArenaRequest, now: float) -> m.ArenaReply:
    """Grant the producer an arena: a slice of the pool and a block of lease slots it publishes in."""
    if core.draining:
        raise MmfeatError(ErrorCode.DRAINING, "the daemon is shutting down; no new arenas")
    if not core.arenas_enabled:
        raise MmfeatError(ErrorCode.BAD_STATE,
                          "this daemon grants no arenas (arena_mb = 0, or no libatomic); reserve instead")
    # First: it may cut this session. Unacked publishes stay left as timer sweeps leave them: a producer
    # ahead of its consumers asks for arenas as it goes, and adopting its burst here one by one would
    # cost more than the burst's whole batch.
    core.sweep(now, defer_unacked=True)
    session = core.sessions.get(req.session)
    if session is None:
        core.check_not_cut(req.session)
    if session is None or not session.attached:
        raise MmfeatError(ErrorCode.BAD_STATE,
                          "connect the fd channel before asking for an arena, so a crash returns it")
    pool_id = core.pool_for(req.device)
    a = core.arenas.grant(req.session, pool_id, req.nbytes)
    core.ledger.clear_block(a)
    return m.ArenaReply(ArenaGrant(a.arena_id, a.pool_id, a.offset, a.size, a.slot_base, a.slots))


def arena_return(core: DaemonCore, req: m.ArenaReturnRequest, now: float) -> m.EmptyReply:
    """The producer places nothing more in this arena; it is freed once no feature in it is live."""
    a = core.arenas.get(req.arena)
    if a is None or a.session != req.session:
        raise MmfeatError(ErrorCode.NOT_FOUND, f"this session holds no arena {req.arena}")
    core.sweep(now)  # adopt what it published there first
    core.arenas.give_back(a)
    return m.EmptyReply()


def publish(core: DaemonCore, req: m.PublishRequest, now: float) -> m.LeaseReply:
    """The producer finished writing: the lease becomes readable and its ack deadline starts."""
    # So that a feature published in an arena is known, and refused here as already published: a publish
    # naming an arena's lease must find it adopted, so this sweep leaves nothing waiting unadopted.
    core.sweep(now)
    return _lease_reply(core, core.ledger.publish(req.lease, req.session, now), now)


def ack(core: DaemonCore, req: m.AckRequest, now: float) -> Union[m.AckReply, Deferred]:
    """``count`` consumers are done; acks beyond what the lease expects are counted, not applied. An ack
    of another node's feature is relayed to its daemon, batched; a waiting one is answered from there."""
    if req.node is not None and req.node != core.settings.node_id:
        remote = _remote(core)
        return Deferred(lambda respond: remote.relay_ack(req.node, req.lease, req.count, req.ack_id, respond, now))
    core.sweep(now)  # the lease may be a feature published in an arena since the last sweep
    result = core.ledger.ack(req.lease, req.count, now, req.ack_id)
    return m.AckReply(result.remaining, result.freed, result.over_acked, result.duplicate)


def release(core: DaemonCore, req: m.ReleaseRequest, now: float) -> m.ReleaseReply:
    """The producer cancels a lease it never dispatched; it is freed at once."""
    core.sweep(now)
    core.ledger.release(req.lease, req.session, now)
    return m.ReleaseReply(True)


def lookup(core: DaemonCore, req: m.LookupRequest, now: float) -> m.LeaseReply:
    """Is this lease live, with this generation and token? Consumers verify before reading."""
    core.sweep(now)
    return _lease_reply(core, core.ledger.lookup(req.lease), now)


def remote_get(core: DaemonCore, req: m.RemoteGetRequest, now: float) -> Deferred:
    """A feature another node's daemon owns, made readable here: answered once it is (SPEC.md, section 11).
    A quiet one is a prefetch: the pull starts, and nobody waits for it."""
    remote = _remote(core)

    return Deferred(lambda respond: remote.get(req.node, req.lease, req.wait_s, respond, now, req.into_pool, req.pull))


def fallback(core: DaemonCore, req: m.FallbackRequest, now: float) -> m.EmptyReply:
    """A client sent ``count`` features inline for ``reason``; counted for operators."""
    fb = core.counters.fallbacks
    fb[req.reason.value] = fb.get(req.reason.value, 0) + req.count
    return m.EmptyReply()


def ping(core: DaemonCore, req: m.EmptyRequest, now: float) -> m.PingReply:
    """Liveness; it also applies what clients wrote in the lease table, so a client's flush() (a ping on
    its fd channel) returns once its table acks are applied."""
    core.sweep(now)
    return m.PingReply(core.epoch, core.settings.node_id, core.draining)


def stats(core: DaemonCore, req: m.EmptyRequest, now: float) -> m.StatsReply:
    return m.StatsReply(**core.stats())


def pool_info(core: DaemonCore, req: m.EmptyRequest, now: float) -> m.PoolInfoReply:
    return m.PoolInfoReply(core.epoch, tuple(p.info(core.epoch) for p in core.pools.values()))


Handler = Callable[[DaemonCore, Any, float], Union[Reply, Deferred]]

HANDLERS: dict[str, Handler] = {
    "hello": hello,
    "reserve": reserve,
    "publish": publish,
    "ack": ack,
    "release": release,
    "lookup": lookup,
    "remote_get": remote_get,
    "arena": arena,
    "arena_return": arena_return,
    "fallback": fallback,
    "ping": ping,
    "stats": stats,
    "pool_info": pool_info,
}

assert HANDLERS.keys() == m.REQUEST_MODELS.keys() == m.REPLY_TYPES.keys(), \
    "every op needs a request model, a reply type and a handler"
