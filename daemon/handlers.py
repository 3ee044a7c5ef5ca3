"""One handler per op, in one explicit table. Each takes the validated request and returns the reply body.

A handler returns its op's reply type (protos/messages.py, REPLY_TYPES) or a Deferred one, and raises
MmfeatError for a refusal; daemon/dispatch.py turns either into a reply frame.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from mmfeat.protos import messages as m
from mmfeat.protos.codec import MAX_REQUEST_BYTES
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.handshake import ArenaGrant
from mmfeat.protos.keys import MAX_LOOKUP_KEYS

from .core import DaemonCore, Remote
from .leases.allocator import align_up
from .leases.keys import dedups, hold_descriptor
from .leases.lease import EndReason
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


def _lease_ref(core: DaemonCore, lease: Any) -> m.LeaseRefReply:
    return m.LeaseRefReply(lease.pool_id, core.epoch, lease.lease_id, lease.gen, lease.token, lease.offset,
                           lease.nbytes)


def _lease_reply(core: DaemonCore, lease: Any, now: float, descriptor: Optional[bytes] = None) -> m.LeaseReply:
    # The lease's own deadline, not the TTL hello reported: a reload changes the TTL of leases granted
    # after it, and the producer must know when this one ends. A feature that nothing times (retained,
    # held) has none to tell.
    left = lease.deadline - now
    expires_in = max(0.0, left) if math.isfinite(left) else None
    return m.LeaseReply(_lease_ref(core, lease), lease.state.value, lease.consumers, lease.remaining, expires_in,
                        descriptor)


def _attached(core: DaemonCore, token: bytes, op: str) -> None:
    """Raise unless ``token`` is a session with its fd channel attached (whose end frees what it holds)."""
    session = core.sessions.get(token)
    if session is None:
        core.check_not_cut(token)
        raise MmfeatError(ErrorCode.NOT_FOUND, "unknown session (expired, or from before a daemon restart): reconnect")
    if not session.attached:
        raise MmfeatError(ErrorCode.BAD_STATE, f"connect the fd channel before {op}, so a crash frees what you hold")


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
        gpu_publish=core.gpu_publish,
        bind=core.arenas_enabled,  # keyed and retained features in arenas, bound by a message (SPEC.md, bind)
        ready_ttl=core.ledger.unwritten.ready_ttl,
        pins=core.arenas_enabled,  # retained features pinned in their ACKS word (SPEC.md, section 5); swept
        feed=core.feed_endpoint,  # "" when the feed could not listen: clients then ask for every key
        # CLOCK_MONOTONIC here: a client on the same kernel sees the same clock and may then send
        # request deadlines (SPEC.md, section 2).
        clock=now,
    )


def reserve(core: DaemonCore, req: m.ReserveRequest, now: float) -> m.LeaseReply:
    """Allocate a slice for ``nbytes`` that ``consumers`` consumers will acknowledge."""
    if core.draining:
        raise MmfeatError(ErrorCode.DRAINING, "the daemon is shutting down; send this feature inline")
    # First the session's own slots: a sweep may cut this very session (SPEC.md, section 9), and acks
    # there give back its quota. What it leaves unadopted (as the arena op's does) holds no range this
    # could take: an arena's space is its arena's.
    core.sweep_session(now, req.session, defer_unacked=True)
    _reserving(core, req.session)
    pool_id = core.pool_for(req.device)
    if req.key is not None:
        live = _found(core, req.key, now)
        if live is not None and dedups(live, req.retain_ttl):
            # Dedup before any byte is written: the producer gets the live feature instead of a lease.
            core.counters.dedups += 1
            core.ledger.keys.count(req.key, "dedups")
            return _lease_reply(core, live, now, live.descriptor)
    alloc = core.ledger.allocators[pool_id]
    if not (core.ledger.fits(pool_id, req.nbytes)
            and core.books.admits_single(req.session, align_up(req.nbytes, alloc.alignment))):
        # Acks other sessions wrote may have freed the room this needs (and a published feature's quota
        # is freed by acks in slots the daemon does not list by session): the whole table, before the
        # reserve evicts retained features or refuses.
        core.sweep(now, defer_unacked=True)
        _reserving(core, req.session)
    t0 = time.perf_counter()
    lease = core.ledger.reserve(req.session, pool_id, req.nbytes, req.consumers, now, key=req.key,
                                retain_ttl=req.retain_ttl)
    if core.observe_reserve is not None:
        core.observe_reserve(time.perf_counter() - t0)
    return _lease_reply(core, lease, now)


def _reserving(core: DaemonCore, token: bytes) -> None:
    """Raise unless ``token`` is a session, not cut, with its fd channel attached."""
    session = core.sessions.get(token)
    if session is None:
        core.check_not_cut(token)
        raise MmfeatError(ErrorCode.NOT_FOUND, "unknown session (expired, or from before a daemon restart): reconnect")
    if not session.attached:
        raise MmfeatError(ErrorCode.BAD_STATE, "connect the fd channel before reserving, so a crash frees your leases")


def _found(core: DaemonCore, key: str, now: float) -> Any:
    """The live feature under ``key``, after a sweep of its slot (acks there may have ended it)."""
    live = core.ledger.keys.find(key)
    if live is None:
        return None
    core.sweep(now, slots=(live.lease_id,))
    return core.ledger.keys.find(key)


def arena(core: DaemonCore, req: m.ArenaRequest, now: float) -> m.ArenaReply:
    """Grant the producer an arena: a slice of the pool and a block of lease slots it publishes in."""
    if core.draining:
        raise MmfeatError(ErrorCode.DRAINING, "the daemon is shutting down; no new arenas")
    if not core.arenas_enabled:
        raise MmfeatError(ErrorCode.BAD_STATE,
                          "this daemon grants no arenas (arena_mb = 0, or no libatomic); reserve instead")
    # No sweep first: a grant depends on no table word while there is room, and a producer ahead of its
    # consumers asks for an arena every few dozen features, each ask costing a cache-cold sweep of all
    # its arenas' blocks (most of what a burst cost the daemon). A session whose words would cut it is
    # cut by the timer's next sweep, which gives back this arena with the others.
    _arena_holder(core, req.session)
    pool_id = core.pool_for(req.device)
    if not core.arenas.room_for(req.session, pool_id, req.nbytes):
        # Acks may have freed a range or a block (a returned arena's last feature), and a sweep may cut
        # this session: the whole table, unacked publishes left as timer sweeps leave them.
        core.sweep(now, defer_unacked=True)
        _arena_holder(core, req.session)
    a = core.arenas.grant(req.session, pool_id, req.nbytes)
    core.ledger.clear_block(a)
    return m.ArenaReply(ArenaGrant(a.arena_id, a.pool_id, a.offset, a.size, a.slot_base, a.slots))


def _arena_holder(core: DaemonCore, token: bytes) -> None:
    session = core.sessions.get(token)
    if session is None:
        core.check_not_cut(token)
    if session is None or not session.attached:
        raise MmfeatError(ErrorCode.BAD_STATE,
                          "connect the fd channel before asking for an arena, so a crash returns it")


def arena_return(core: DaemonCore, req: m.ArenaReturnRequest, now: float) -> m.EmptyReply:
    """The producer places nothing more in this arena; it is freed once no feature in it is live."""
    a = core.arenas.get(req.arena)
    if a is None or a.session != req.session:
        raise MmfeatError(ErrorCode.NOT_FOUND, f"this session holds no arena {req.arena}")
    core.sweep(now, slots=(), blocks=[(a.slot_base, a.slot_base + a.slots)])  # adopt what it published there first
    core.arenas.give_back(a)
    return m.EmptyReply()


def publish(core: DaemonCore, req: m.PublishRequest, now: float) -> m.LeaseReply:
    """The producer finished writing: the lease becomes readable and its ack deadline starts."""
    # So that a feature published in an arena is known, and refused here as already published: a publish
    # naming an arena's lease must find it adopted, so this sweep (of its slot) leaves nothing unadopted.
    core.sweep_lease(now, req.lease)
    lease = core.ledger.publish(req.lease, req.session, now, req.descriptor, req.stream_ready)
    return _lease_reply(core, lease, now, lease.descriptor)


def bind(core: DaemonCore, req: m.BindRequest, now: float) -> m.LeaseReply:
    """A key and a lifetime for a feature the producer published in its arena: the key finds it from here
    (unless it names a live feature already, which it keeps naming), and a retained one counts no
    consumers from here."""
    core.sweep_lease(now, req.lease)  # its table store: adopted here if no sweep has yet
    lease, descriptor = core.ledger.bind(req.lease, req.session, now, req.key, req.retain_ttl, req.descriptor)
    return _lease_reply(core, lease, now, descriptor)


def _read_binds_first(core: DaemonCore, keys: Sequence[str] = (), ref: Optional[m.LeaseRef] = None) -> None:
    """Handle what waits on the fd channels before a lookup by key would miss, or before a hold names a
    feature awaiting its bind. A producer's put returns once its bind is in its fd channel's buffer,
    and the request that looks the feature up was sent after that (its consumer learnt of the feature
    from the producer): so what was put is found, however the daemon reads its sockets."""
    ledger = core.ledger
    if ref is not None:
        lease = ledger.live_lease(ref.lease)
        unbound = lease is None or lease.gen != ref.gen or lease.awaiting_bind
    else:
        unbound = any(ledger.keys.find(key) is None for key in keys)
    if unbound:
        core.read_waiting()


def ack(core: DaemonCore, req: m.AckRequest, now: float) -> Union[m.AckReply, Deferred]:
    """``count`` consumers are done; acks beyond what the lease expects are counted, not applied. An ack
    of another node's feature is relayed to its daemon, batched; a waiting one is answered from there."""
    if req.node is not None and req.node != core.settings.node_id:
        remote = _remote(core)
        return Deferred(lambda respond: remote.relay_ack(req.node, req.lease, req.count, req.ack_id, respond, now))
    core.sweep_lease(now, req.lease)  # it may be a feature published in an arena since the last sweep
    result = core.ledger.ack(req.lease, req.count, now, req.ack_id)
    return m.AckReply(result.remaining, result.freed, result.over_acked, result.duplicate)


def release(core: DaemonCore, req: m.ReleaseRequest, now: float) -> m.ReleaseReply:
    """The producer cancels a lease it never dispatched; it is freed at once."""
    core.sweep_lease(now, req.lease)
    core.ledger.release(req.lease, req.session, now)
    return m.ReleaseReply(True)


def lookup(core: DaemonCore, req: m.LookupRequest, now: float) -> m.LeaseReply:
    """Is this lease live, with this generation and token? Consumers verify before reading."""
    core.sweep_lease(now, req.lease)
    return _lease_reply(core, core.ledger.lookup(req.lease), now)


def lookup_key(core: DaemonCore, req: m.LookupKeyRequest, now: float) -> m.LookupKeyReply:
    """Which keys name a live feature (has_many), and with ``descriptors`` their descriptors (lookup)."""
    if len(req.keys) > MAX_LOOKUP_KEYS:
        core.counters.too_large += 1
        raise MmfeatError(ErrorCode.TOO_LARGE, f"{len(req.keys)} keys in one lookup_key, over the {MAX_LOOKUP_KEYS} "
                          "a request may carry: split the list")
    index = core.ledger.keys
    _read_binds_first(core, req.keys)
    # Acks in the table may have ended some: the slots of the features found, not the whole table.
    core.sweep(now, slots=[lease.lease_id for lease in map(index.find, req.keys) if lease is not None])
    found, descs = [], []
    for key in req.keys:
        lease = index.find(key)
        hit = lease is not None
        found.append(hit)
        descs.append(lease.descriptor if hit else None)
        index.count(key, "hits" if hit else "misses")
        if hit:
            core.counters.key_hits += 1
        else:
            core.counters.key_misses += 1
    return m.LookupKeyReply(tuple(found), tuple(descs) if req.descriptors else None)


def hold(core: DaemonCore, req: m.HoldRequest, now: float) -> m.HoldReply:
    """A hold on a retained feature for ``count`` readers, ended by their acks or with this session."""
    if (req.key is None) == (req.lease is None):
        raise MmfeatError(ErrorCode.BAD_REQUEST, "hold: name the feature by key or by lease, exactly one of them")
    ledger = core.ledger
    _read_binds_first(core, (req.key,) if req.key is not None else (), req.lease)
    found = ledger.keys.find(req.key) if req.key is not None else None
    slots = [s for s in (req.lease.lease if req.lease is not None else None,
                         found.lease_id if found is not None else None) if s is not None]
    # A hold is a slot of this session's, so words there may cut it; acks in the feature's slot may have
    # ended it. One sweep reads both.
    core.sweep_session(now, req.session, also=slots)
    if ledger.live >= ledger.max_leases or not ledger.space.has_single:
        core.sweep(now)  # other sessions' acks may have freed a slot for the hold
    _attached(core, req.session, "holding")
    if req.key is not None:
        base = ledger.keys.find(req.key)
        if base is None:
            ledger.keys.count(req.key, "misses")
            core.counters.key_misses += 1
            raise MmfeatError(ErrorCode.NOT_FOUND, "no live feature under that key (never put, ended, evicted, or "
                              "from before a daemon restart): put it again")
        ledger.keys.count(req.key, "hits")
        core.counters.key_hits += 1
    else:
        base = ledger.resolve(req.lease)
    h = ledger.hold(base, req.session, req.count, now)
    return m.HoldReply(_lease_ref(core, h), hold_descriptor(base, h))


def hold_keys(core: DaemonCore, req: m.HoldKeysRequest, now: float) -> m.HoldKeysReply:
    """A lookup and a hold in one request (a scheduler's, for the items it is about to load): each live
    retained key held for ``count`` readers, a counted one answered with its own descriptor (its consumer
    count protects its readers), a miss with nil. All of the holds or none: a refused hold gives back
    those this request took before it."""
    if len(req.keys) > MAX_LOOKUP_KEYS:
        core.counters.too_large += 1
        raise MmfeatError(ErrorCode.TOO_LARGE, f"{len(req.keys)} keys in one hold_keys, over the {MAX_LOOKUP_KEYS} "
                          "a request may carry: split the list")
    ledger = core.ledger
    _read_binds_first(core, req.keys)  # a key its producer bound before this was asked is found
    # Not this session's own slots first, as for an arena: the holds depend on no word there while its
    # quota has room for them, and a session whose words would cut it is cut by the timer's next sweep.
    # Acks of its earlier holds there give back quota: swept when the holds would not fit without them.
    if not core.books.admits_holds(req.session, len(req.keys)):
        core.sweep_session(now, req.session)
    core.sweep(now, slots=[lease.lease_id for lease in map(ledger.keys.find, req.keys) if lease is not None])
    if ledger.live + len(req.keys) > ledger.max_leases or not ledger.space.has_single:
        core.sweep(now)  # other sessions' acks may have freed slots for the holds
    _attached(core, req.session, "holding")
    descs: list[Optional[bytes]] = []
    held: list[bool] = []
    taken = []
    try:
        for key in req.keys:
            base = ledger.keys.find(key)
            ledger.keys.count(key, "misses" if base is None else "hits")
            if base is None:
                core.counters.key_misses += 1
                descs.append(None)
                held.append(False)
                continue
            core.counters.key_hits += 1
            if base.retain_ttl is None:
                descs.append(base.descriptor)
                held.append(False)
                continue
            h = ledger.hold(base, req.session, req.count, now)
            taken.append(h)
            descs.append(hold_descriptor(base, h))
            held.append(True)
    except MmfeatError:
        for h in taken:
            ledger.end(h, EndReason.RELEASED, now)
        raise
    return m.HoldKeysReply(tuple(descs), tuple(held))


def evict(core: DaemonCore, req: m.EvictRequest, now: float) -> m.EvictReply:
    """No key finds the feature from now on; a retained one is freed as soon as nothing holds it."""
    _read_binds_first(core, (req.key,))
    live = _found(core, req.key, now)
    if live is not None and live.holds:
        core.sweep(now)  # acks of its holds, in their holders' slots, may have ended them
    evicted, held = core.ledger.evict(req.key, now)
    return m.EvictReply(evicted, held)


def remote_get(core: DaemonCore, req: m.RemoteGetRequest, now: float) -> Deferred:
    """A feature another node's daemon owns, made readable here: answered once it is (SPEC.md, section 11).
    A quiet one is a prefetch: the pull starts, and nobody waits for it."""
    remote = _remote(core)
    hold = None
    if req.hold is not None or req.session is not None:
        if req.hold is None or req.session is None:
            raise MmfeatError(ErrorCode.BAD_REQUEST, "remote_get: hold and session go together (the session holds "
                              "the copy for hold readers)")
        _attached(core, req.session, "holding")
        hold = (req.session, req.hold)
    return Deferred(lambda respond: remote.get(req.node, req.lease, req.wait_s, respond, now, req.into_pool, req.pull,
                                               hold))


def fallback(core: DaemonCore, req: m.FallbackRequest, now: float) -> m.EmptyReply:
    """A client sent ``count`` features inline for ``reason``; counted for operators."""
    fb = core.counters.fallbacks
    fb[req.reason.value] = fb.get(req.reason.value, 0) + req.count
    return m.EmptyReply()


def ping(core: DaemonCore, req: m.EmptyRequest, now: float) -> m.PingReply:
    """Liveness; it also applies what clients wrote in the lease table, so a client's flush() (a ping on
    its fd channel) returns once its table acks are applied. Those are in other sessions' slots (the
    features it read), so this sweeps the whole table."""
    core.sweep(now)
    return m.PingReply(core.epoch, core.settings.node_id, core.draining)


def stats(core: DaemonCore, req: m.EmptyRequest, now: float) -> m.StatsReply:
    # Binds and acks a client sent before asking wait on its fd channel: exact means they count.
    core.read_waiting()
    return m.StatsReply(**core.stats())


def pool_info(core: DaemonCore, req: m.EmptyRequest, now: float) -> m.PoolInfoReply:
    return m.PoolInfoReply(core.epoch, tuple(p.info(core.epoch) for p in core.pools.values()))


Handler = Callable[[DaemonCore, Any, float], Union[Reply, Deferred]]

HANDLERS: dict[str, Handler] = {
    "hello": hello,
    "reserve": reserve,
    "publish": publish,
    "bind": bind,
    "ack": ack,
    "release": release,
    "lookup": lookup,
    "lookup_key": lookup_key,
    "hold": hold,
    "hold_keys": hold_keys,
    "evict": evict,
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
