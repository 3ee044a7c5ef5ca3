"""Features that cross nodes: gets of other nodes' features, and this node's side of theirs.

As the consumer's node (a client here asks for a feature another node's daemon owns):
- ``get`` pulls the lease's bytes into a lease of this daemon's pool with one NIXL READ, then READs the
  owner's lease-table entry of the lease (a peer without a table is asked with a ``check`` message):
  only if it still shows the feature were the bytes read its bytes, and the copy is published here and
  handed to every client waiting for it. Concurrent and later gets of the same feature on this node
  share the copy: one pull per feature per node. A get with ``hold`` is answered with a hold over the
  copy for its readers instead. How long a copy lives: copies.py.
- A FABRIC pool in the same NVLink domain (both nodes announce the same cluster UUID and clique id) is
  not pulled: the client gets the relayed handle and maps the owner's memory itself, after a ``check``.
  A client whose import of it fails anyway asks again with ``pull``, and the feature is pulled.
- ``relay_ack`` hands consumers' acks to the owner, batched (outbox.py).

As the owner (another node pulls or acks a feature of ours): ``on_check`` records who pulled what,
``on_acks`` applies acks with the usual clamp and counts, and every freed feature that a peer pulled
is announced to it (``ended``), batched the same way.

Everything a peer sends is untrusted beyond its identity: leases are resolved by the ledger exactly as
a local client's would be.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
from typing import Any, Optional

from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.mesh import MeshAck, MeshFabricDomain, MeshPool
from mmfeat.protos.messages import LeaseRef, RemoteGetReply

from ..core import DaemonCore
from ..leases.lease import EndReason, Lease, LeaseState
from .copies import Check as _Check, Copy as _Copy, Waiter, copy_pool, fabric_reply, route
from .copies import lease_ref_reply as _lease_ref
from .outbox import MeshOutbox, PeerCounters, Respond, peer_error
from .peers import Mesh, PeerState
from .puller import Puller, ReadJob, Result, Verify

__all__ = ["PULL_HOLD_S", "RemoteFeatures", "copy_pool", "fabric_reply", "route"]

log = logging.getLogger("mmfeatd.remote")

# A copy is reserved for as long as its pull may take; it is published or released explicitly when the
# pull ends, and this only bounds a pull that never reports.
PULL_HOLD_S = 3600.0
# A check answer that takes longer than this (past the client's own deadline) means the owner is gone.
CHECK_TIMEOUT_S = 30.0
# A get with a hold whose wait ran out while the pull goes on is told so: it may ask again.
_STILL_PULLING = ("the pull of the feature from node {node!r} is still under way; the get's wait_s ran out before "
                  "it landed, and the pull goes on: ask again")


class RemoteFeatures:
    def __init__(self, core: DaemonCore, mesh: Mesh, puller: Optional[Puller], no_puller: str,
                 fabric_domain: Optional[dict[str, Any]] = None) -> None:
        self.core = core
        self.mesh = mesh
        self.puller = puller
        self._no_puller = no_puller
        self.session = secrets.token_bytes(16)  # the producer of pulled copies; no client can name it
        self._ids = itertools.count(1)
        self._copies: dict[tuple, _Copy] = {}
        self._by_job: dict[int, _Copy] = {}
        self._by_local: dict[tuple[int, int], _Copy] = {}
        self._by_owner: dict[tuple[str, int, int, int], list[_Copy]] = {}
        self._checks: dict[int, _Check] = {}
        self._pulled_by: dict[tuple[int, int], set[str]] = {}
        self._node_keys: dict[str, str] = {}  # node -> the key of the peer copies of its features came from
        self.counters: dict[str, PeerCounters] = {}
        self.outbox = MeshOutbox(mesh, core.epoch, self.peer_counters)
        # Set only where this node's FABRIC pools (its probe found an NVLink domain with IMEX) share one.
        self.fabric_domain = MeshFabricDomain(**fabric_domain) if fabric_domain else None
        self.next_due = math.inf  # the earliest deadline of a client waiting for a pull (answer_due)

    def peer_counters(self, peer: str) -> PeerCounters:
        return self.counters.setdefault(peer, PeerCounters())

    # --- a client here asks for another node's feature ----------------------------------------

    def get(self, node: str, ref: LeaseRef, timeout: float, respond: Optional[Respond], now: float,
            into_pool: Optional[int] = None, pull: bool = False, hold: Optional[tuple[bytes, int]] = None) -> None:
        """``respond`` None: a prefetch, which starts the pull (or finds it under way) and waits for nothing.
        ``into_pool``: where the client would like the copy (copy_pool). ``pull``: pulled even on the
        FABRIC route, whose handle the client could not import. ``hold``: (session, readers): answered
        with a hold over the copy for that many readers, taken by ``session`` (pulled on every route)."""
        peer = self._peer(node)
        hello = peer.hello
        assert hello is not None
        if ref.epoch != hello.epoch:
            raise MmfeatError(ErrorCode.STALE, f"descriptor is from epoch {ref.epoch} of node {node!r}'s daemon, which "
                                               f"is now epoch {hello.epoch}: it restarted and the feature is gone")
        pool = next((p for p in hello.pools if p.pool == ref.pool), None)
        if pool is None:
            raise MmfeatError(ErrorCode.NOT_FOUND, f"node {node!r}'s daemon has no pool {ref.pool}")
        if ref.offset + ref.nbytes > pool.size:
            raise MmfeatError(ErrorCode.FORBIDDEN,
                              f"lease [{ref.offset}, +{ref.nbytes}) is outside pool {ref.pool} of {node!r}")
        deadline = now + timeout * 0.9
        if pull and respond is not None:
            self.peer_counters(peer.config.public_key).fabric_fallbacks += 1
        waiter = Waiter(respond, deadline, hold) if respond is not None else None
        if route(pool, self.fabric_domain, hello.fabric_domain, pull or hold is not None) == "fabric":
            if waiter is not None:  # nothing to fetch ahead: the client maps the owner's memory itself
                self._check(peer, ref, None, [waiter], pool, now)
            return
        key = (peer.config.public_key, *ref.model_dump().values())
        copy = self._copies.get(key)
        if copy is not None:
            if copy.state == "ready":
                if self.core.ledger.live_lease(copy.local.lease_id) is copy.local:
                    if waiter is not None:
                        self.peer_counters(copy.peer).shared_gets += 1
                        self._hand(copy, waiter, now)
                    return
                self._forget(copy)  # expired or evicted here; pull again
            elif copy.state != "failed":
                if waiter is not None:
                    self.peer_counters(copy.peer).shared_gets += 1
                    copy.waiters.append(waiter)
                    self.next_due = min(self.next_due, deadline)
                copy.deadline = max(copy.deadline, deadline)
                return
        self._pull(peer, node, ref, pool, key, [waiter] if waiter is not None else [], deadline, now, into_pool)

    def _peer(self, node: str) -> PeerState:
        if not node or node == self.core.settings.node_id:
            raise MmfeatError(ErrorCode.BAD_REQUEST, "remote_get names this node; get() reads its features directly")
        peer = self.mesh.peer_for_node(node)
        if peer is None:
            raise MmfeatError(ErrorCode.PEER_UNAVAILABLE,
                              f"node {node!r} is not a peer that is up (listed in peers, answering heartbeats); "
                              "see mmfeat stats on both nodes")
        return peer

    def _pull(self, peer: PeerState, node: str, ref: LeaseRef, pool: MeshPool, key: tuple,
              waiters: list[Waiter], deadline: float, now: float, into_pool: Optional[int]) -> None:
        if self.core.draining:
            raise MmfeatError(ErrorCode.DRAINING,
                              "this daemon is shutting down and pulls nothing more; retry on its successor")
        if self.puller is None:
            raise MmfeatError(ErrorCode.NO_TRANSPORT, self._no_puller)
        if not pool.addr:
            raise MmfeatError(ErrorCode.NO_TRANSPORT, f"pool {pool.pool} of node {node!r} is not registered with NIXL "
                                                       "(see that daemon's log); send such features inline")
        assert peer.hello is not None
        if peer.hello.nixl is None:
            raise MmfeatError(ErrorCode.NO_TRANSPORT,
                              f"node {node!r}'s daemon has no NIXL; install 'mmfeat[mesh]' there")
        table = peer.hello.table
        if table is not None and ref.lease >= table.slots:
            raise MmfeatError(ErrorCode.NOT_FOUND, f"node {node!r}'s daemon has no lease slot {ref.lease}")
        local_pool = copy_pool(self.puller.regions, into_pool)
        region = self.puller.regions[local_pool]
        if not self.core.ledger.fits(local_pool, ref.nbytes):
            self.core.sweep(now)  # acks written since the last sweep may free the room this needs
        # Retained, so that clients here may hold it; its retain_ttl is moved at every handout (_hand).
        lease = self.core.ledger.reserve(self.session, local_pool, ref.nbytes, 1, now, ttl=PULL_HOLD_S, quota=False,
                                         retain_ttl=self.core.ledger.ack_ttl)
        job = next(self._ids)
        copy = _Copy(key, peer.config.public_key, node, ref, job, lease, waiters=waiters, deadline=deadline,
                     verified=table is not None)
        self._copies[key] = copy
        self._node_keys[node] = copy.peer
        self._by_job[job] = copy
        self._by_local[(lease.lease_id, lease.gen)] = copy
        self._by_owner.setdefault((copy.peer, ref.epoch, ref.lease, ref.gen), []).append(copy)
        self.peer_counters(copy.peer).pulls += 1
        self.next_due = min(self.next_due, deadline)
        ended = self.puller.read(ReadJob(
            job, copy.peer, pool.addr + ref.offset, "DRAM" if pool.kind == "host" else "VRAM",
            0 if pool.kind == "host" else pool.device, region.addr + lease.offset, region.mem, region.device,
            ref.nbytes, deadline,
            # The owner's lease table says, after the bytes, whether they were the feature's: no message.
            Verify(table.addr, table.slots, ref.lease, ref.gen, ref.pool, ref.offset, ref.nbytes, ref.token)
            if table is not None else None,
        ), now)
        if ended is not None:
            self.on_pulled([ended], now)

    def on_pulled(self, results: list[Result], now: float) -> None:
        for result in results:
            copy = self._by_job.pop(result.job, None)
            if copy is None:
                continue
            if copy.state == "failed":  # its waiters were answered already; the range can go now
                self._release(copy, now)
                continue
            if not result.ok:
                if result.code:  # the owner's table showed the feature gone, or not as the descriptor says
                    self._fail(copy, MmfeatError(ErrorCode(result.code), f"node {copy.node!r}: {result.error}"), now)
                    continue
                self.peer_counters(copy.peer).pull_failures += 1
                self._fail(copy, MmfeatError(ErrorCode.PEER_UNAVAILABLE,
                                             f"pull from node {copy.node!r} failed: {result.error}"), now)
                continue
            self.peer_counters(copy.peer).bytes_pulled += copy.local.nbytes
            peer = self.mesh.peers.get(copy.peer)
            ref = copy.ref
            if copy.verified:
                self._ready(copy, now)
                self.outbox.pulled(copy.peer, ref.model_dump(), now)  # so the owner says when it ends
                continue
            copy.state = "checking"
            if peer is None or not self._check(peer, ref, copy, copy.waiters, None, now):
                self._fail(copy, MmfeatError(ErrorCode.PEER_UNAVAILABLE,
                                             f"node {copy.node!r} cannot be asked now"), now)

    def _check(self, peer: PeerState, ref: LeaseRef, copy: Optional[_Copy], waiters: list[Waiter],
               pool: Optional[MeshPool], now: float) -> bool:
        req = next(self._ids)
        if not self.mesh.send(peer, "check", {"req": req, "lease": ref.model_dump()}):
            if copy is None:
                raise MmfeatError(ErrorCode.PEER_UNAVAILABLE,
                                  f"node {peer.hello.node if peer.hello else '?'!r} is not reading")
            return False
        deadline = max((w.deadline for w in waiters), default=now + CHECK_TIMEOUT_S)
        self._checks[req] = _Check(peer.config.public_key, copy, waiters, pool, ref, deadline)
        return True

    def on_checked(self, peer: PeerState, req: int, code: str, message: str, now: float) -> None:
        check = self._checks.get(req)
        if check is None or check.peer != peer.config.public_key:
            return  # late, or an answer to a question this peer was never asked
        del self._checks[req]
        copy, pool, ref = check.copy, check.pool, check.ref
        error = peer_error(code, message, peer) if code else None
        if copy is None:  # the FABRIC route: nothing was copied
            assert pool is not None and peer.hello is not None
            for w in check.waiters:
                w.respond(error or fabric_reply(peer.hello.node, peer.hello.epoch, pool, ref))
            return
        if copy.state != "checking":
            return
        if error is not None:
            self._fail(copy, error, now)
            return
        self._ready(copy, now)

    def _ready(self, copy: _Copy, now: float) -> None:
        """The copy holds the feature's bytes: published here, handed to everyone waiting for it."""
        self.core.pools[copy.local.pool_id].remote_writes_landed()  # before anyone reads them
        self.core.ledger.publish(_ref(self.core, copy.local), self.session, now)
        copy.state = "ready"
        waiters, copy.waiters = copy.waiters, []
        for w in waiters:
            self._hand(copy, w, now)

    def _hand(self, copy: _Copy, w: Waiter, now: float) -> None:
        """Answer ``w`` with the ready copy, or with a hold over it for its readers. The copy then lives
        at least an ack_ttl more, and a plain get's readers, who hold nothing, keep it from eviction."""
        ledger = self.core.ledger
        ledger.renew(copy.local, now + ledger.ack_ttl)
        if w.hold is None:
            copy.handed += 1
            if not copy.plain:
                copy.plain = True
                ledger.keys.not_retained(copy.local)  # out of eviction's reach: nothing protects in-place reads
            w.respond(RemoteGetReply(_lease_ref(_ref(self.core, copy.local))))
            return
        session, readers = w.hold
        try:
            if self.core.sessions.get(session) is None:
                raise MmfeatError(ErrorCode.NOT_FOUND, "the session that asked for the hold has ended")
            if not self.core.books.admits_holds(session, 1):
                self.core.sweep_session(now, session)  # acks of its earlier holds give back its quota
            if ledger.live >= ledger.max_leases or not ledger.space.has_single:
                self.core.sweep(now)  # other sessions' acks may have freed a slot for the hold
            held = ledger.hold(copy.local, session, readers, now)
        except MmfeatError as exc:
            w.respond(exc)
            return
        w.respond(RemoteGetReply(_lease_ref(_ref(self.core, held))))

    def _fail(self, copy: _Copy, error: MmfeatError, now: float) -> None:
        for w in copy.waiters:
            w.respond(error)
        copy.waiters = []
        if self._by_job.get(copy.job) is copy:
            copy.state = "failed"  # NIXL may still write into the range: released when the pull reports
            self._copies.pop(copy.key, None)
        else:
            self._release(copy, now)

    def _release(self, copy: _Copy, now: float) -> None:
        self._forget(copy)
        if self.core.ledger.live_lease(copy.local.lease_id) is copy.local:
            self.core.ledger.release(_ref(self.core, copy.local), self.session, now)

    def _forget(self, copy: _Copy) -> None:
        if self._copies.get(copy.key) is copy:
            del self._copies[copy.key]
        self._by_local.pop((copy.local.lease_id, copy.local.gen), None)
        owner = (copy.peer, copy.ref.epoch, copy.ref.lease, copy.ref.gen)
        owners = self._by_owner.get(owner)
        if owners is not None:
            owners[:] = [c for c in owners if c is not copy]
            if not owners:
                del self._by_owner[owner]

    # --- acks of other nodes' features, relayed ------------------------------------------------

    def relay_ack(self, node: str, ref: LeaseRef, count: int, ack_id: Optional[bytes], respond: Optional[Respond],
                  now: float) -> None:
        copies = self._by_owner.get((self._node_keys.get(node, ""), ref.epoch, ref.lease, ref.gen), [])
        for copy in copies:
            copy.acked += count
        try:
            peer = self._peer(node)
            assert peer.hello is not None
            if ref.epoch != peer.hello.epoch:
                raise MmfeatError(ErrorCode.STALE, f"the feature is from epoch {ref.epoch} of node {node!r}'s "
                                                   f"daemon, now epoch {peer.hello.epoch}: it restarted, and its "
                                                   "features are gone")
        except MmfeatError:
            self._drop_read(list(copies), now)  # no owner will say it ended
            if node in self._node_keys:
                self.peer_counters(self._node_keys[node]).acks_dropped += count
            raise
        self._node_keys[node] = peer.config.public_key  # so that an ack it cannot take later is counted
        self.outbox.ack(peer.config.public_key, MeshAck(lease=ref.model_dump(), count=count, ack_id=ack_id),
                        respond, now)

    # --- our features, as other nodes see them -------------------------------------------------

    def on_check(self, peer: PeerState, ref: LeaseRef, now: float) -> tuple[str, str]:
        """(code, message) for a peer's check; ("", "") when the lease is live and published."""
        self.core.sweep(now)  # a feature published in an arena is known from the next sweep
        try:
            lease = self.core.ledger.lookup(ref)
        except MmfeatError as exc:
            return exc.code.value, exc.message
        if lease.state is not LeaseState.PUBLISHED:
            return ErrorCode.BAD_STATE.value, f"lease {ref.lease} is not published yet"
        self._pulled_by.setdefault((lease.lease_id, lease.gen), set()).add(peer.config.public_key)
        counters = self.peer_counters(peer.config.public_key)
        counters.checks_served += 1
        counters.bytes_served += lease.nbytes
        return "", ""

    def on_pulled_notice(self, peer: PeerState, leases: list[Any], now: float) -> None:
        """A peer pulled these features of ours: it hears ``ended`` for each (at once, if one is gone)."""
        self.core.sweep(now)
        counters = self.peer_counters(peer.config.public_key)
        for m in leases:
            try:
                lease = self.core.ledger.lookup(LeaseRef.model_validate(m.model_dump()))
            except MmfeatError:
                self.outbox.ended(peer.config.public_key, m.lease, m.gen, now)
                continue
            self._pulled_by.setdefault((lease.lease_id, lease.gen), set()).add(peer.config.public_key)
            counters.checks_served += 1
            counters.bytes_served += lease.nbytes

    def on_acks(self, peer: PeerState, acks: list[MeshAck], now: float) -> list[dict[str, Any]]:
        self.core.sweep(now)
        counters = self.peer_counters(peer.config.public_key)
        results = []
        for a in acks:
            try:
                r = self.core.ledger.ack(LeaseRef.model_validate(a.lease.model_dump()), a.count, now, a.ack_id)
            except MmfeatError as exc:
                results.append({"code": exc.code.value, "message": exc.message[:512]})
                continue
            counters.acks_received += a.count
            results.append({"remaining": r.remaining, "freed": r.freed, "over_acked": r.over_acked})
        return results

    def on_ended(self, peer: PeerState, epoch: int, leases: list[list[int]], now: float) -> None:
        for lease_id, gen in leases:
            for copy in list(self._by_owner.get((peer.config.public_key, epoch, lease_id, gen), ())):
                if copy.state == "ready":
                    self._release(copy, now)

    def _drop_read(self, copies: list[_Copy], now: float) -> None:
        """Free the copies that no consumer here reads any more (as many acks here as gets were handed them),
        for features whose owner cannot end them: it is down, restarted or unreachable. A consumer here
        that acks without reading (a cache hit) counts as done reading, as the owner would count it."""
        for copy in copies:
            if copy.state == "ready" and copy.acked >= copy.handed:
                self._release(copy, now)

    def on_free(self, lease: Lease, reason: EndReason, now: float) -> None:
        """The ledger freed ``lease``: a copy of ours is gone, or peers that pulled a feature of ours are told."""
        copy = self._by_local.get((lease.lease_id, lease.gen))
        if copy is not None and copy.local is lease:
            self._forget(copy)
        peers = self._pulled_by.pop((lease.lease_id, lease.gen), None)
        for key in peers or ():
            self.outbox.ended(key, lease.lease_id, lease.gen, now)

    # --- what the mesh hands on ----------------------------------------------------------------

    def on_request(self, peer: PeerState, op: str, body: Any, now: float) -> Optional[tuple[str, dict[str, Any]]]:
        if op == "check":
            code, message = self.on_check(peer, LeaseRef.model_validate(body.lease.model_dump()), now)
            return "checked", {"req": body.req, "code": code, "message": message[:512]}
        if op == "acks":
            return "acked", {"batch": body.batch, "results": self.on_acks(peer, body.acks, now)}
        if op == "pulled":
            self.on_pulled_notice(peer, body.leases, now)
        elif op == "ended":
            self.on_ended(peer, body.epoch, body.leases, now)
        return None

    def on_reply(self, peer: PeerState, op: str, body: Any, now: float) -> None:
        if op == "checked":
            self.on_checked(peer, body.req, body.code, body.message, now)
        elif op == "acked":
            self.outbox.on_acked(peer, body.batch, body.results)

    # --- peers coming and going -----------------------------------------------------------------

    def on_peer_change(self, peer: PeerState, now: float) -> None:
        """``peer`` went down or restarted: what waits on it fails now; what it said before is void."""
        key = peer.config.public_key
        gone = MmfeatError(ErrorCode.PEER_UNAVAILABLE, f"node {peer.config.endpoint} is {peer.state} or restarted")
        for copy in [c for c in self._copies.values() if c.peer == key and c.state != "ready"]:
            self._fail(copy, gone, now)
        epoch = peer.hello.epoch if peer.state == "up" and peer.hello is not None else None
        self._drop_read([c for c in self._copies.values() if c.peer == key and c.ref.epoch != epoch], now)
        for req in [r for r, c in self._checks.items() if c.peer == key]:
            check = self._checks.pop(req)
            if check.copy is None:
                for w in check.waiters:
                    w.respond(gone)
        self.outbox.drop_peer(key, gone)
        for owned in self._pulled_by.values():
            owned.discard(key)
        if self.puller is not None:
            self.puller.remove_peer(key)
            if peer.state == "up" and peer.hello is not None and peer.hello.nixl is not None:
                self.puller.add_peer(key, peer.hello.nixl)

    def on_peer_forgotten(self, key: str) -> None:
        """A peer no longer listed left stats: its counters go with it."""
        self.counters.pop(key, None)
        for node in [n for n, k in self._node_keys.items() if k == key]:
            del self._node_keys[node]

    def answer_due(self, now: float) -> None:
        """Answer the clients whose wait for a pull ran out (the pull goes on for any other): a get with a
        hold hears that it may ask again, a plain get that the owner's node was too late. The server
        calls this at ``next_due``, so that a short wait_s is kept to, not rounded up to a tick."""
        late = MmfeatError(ErrorCode.PEER_UNAVAILABLE, "the owner's node did not complete the transfer in time")
        self.next_due = math.inf
        for copy in list(self._copies.values()):
            if copy.state in ("pulling", "checking"):
                due = [w for w in copy.waiters if w.deadline <= now]
                if due:
                    copy.waiters = [w for w in copy.waiters if w.deadline > now]
                    for w in due:
                        w.respond(late if w.hold is None else
                                  MmfeatError(ErrorCode.TIMED_OUT, _STILL_PULLING.format(node=copy.node)))
                self.next_due = min([self.next_due, *(w.deadline for w in copy.waiters)])

    def tick(self, now: float) -> None:
        """Answer waiters whose time ran out; give up on checks nobody answered."""
        late = MmfeatError(ErrorCode.PEER_UNAVAILABLE, "the owner's node did not complete the transfer in time")
        self.answer_due(now)
        for req, check in list(self._checks.items()):
            if now > check.deadline:
                del self._checks[req]
                if check.copy is None:
                    for w in check.waiters:
                        w.respond(late)
                elif check.copy.state == "checking":
                    self._fail(check.copy, late, now)
        self.outbox.tick(now, late)

    def stats(self) -> dict[str, Any]:
        ready = [c for c in self._copies.values() if c.state == "ready"]
        return {"copies": len(ready), "copy_bytes": sum(c.local.size for c in ready),
                "pulls_in_flight": len(self._by_job), "transport": "nixl" if self.puller else None,
                "transport_error": None if self.puller else self._no_puller}


def _ref(core: DaemonCore, lease: Lease) -> LeaseRef:
    return LeaseRef(pool=lease.pool_id, epoch=core.epoch, lease=lease.lease_id, gen=lease.gen, token=lease.token,
                    offset=lease.offset, nbytes=lease.nbytes)

