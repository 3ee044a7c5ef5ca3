"""The mesh: this daemon's links to the daemons of other nodes, over ZeroMQ CURVE on tcp://.

A ROUTER on ``listen`` takes the peers' DEALERs; a DEALER per listed peer goes the other way. CURVE
encrypts both and a ZAP handler lets in only the keys listed now (each refusal is counted), so a
message's sender is known by the key it proved, never by what it says. Who is listed comes from the
peers' source (membership.py), read again while the daemon runs: a peer added is probed at once; one
no longer listed (its key revoked) is dropped with every connection it has, its queued frames refused.
Each side sends a hello (node, epoch, pools with their FABRIC handle bytes) when it connects and whenever
the other asks for it, and a ping every ``probe_interval_s``; liveness.py says when a peer is up, missing
and gone. A new epoch is a new incarnation, whose predecessor's features are gone (remote.py: STALE).
A request that arrives before the sender's hello (this daemon restarted, or forgot the sender) is held
until the hello comes, which it is asked for at once: the sender cannot know it was not heard, and its
acks would otherwise be lost. Two conditions that would otherwise look like a peer forever ``joining``
or a mesh of STALE answers are states of their own, logged once per peer: ``auth_failed`` (the peer's
ZAP refused our key, which a monitor of our DEALER reports) and ``node_id_conflict`` (the peer
announces our own node id).

This is the membership layer; what travels over it for features (checks after pulls, relayed acks,
ended notices) is daemon/mesh/remote.py's, which the mesh hands every other request and reply to. Every
frame is untrusted input: validated by protos.mesh, counted when bad, never a crash.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Protocol

import zmq
from pydantic import ValidationError
from zmq.auth.thread import ThreadAuthenticator

from mmfeat.protos.mesh import (
    MESH_REPLIES, MESH_REQUESTS, MeshError, MeshHello, MeshPing, MeshPong, decode_mesh, encode_mesh,
)

from ..config import MAX_PEERS, MeshConfigError, Peer, Settings
from ..sockets.connection_cap import ConnectionCap, IsOurs
from .keys import KeyFileError, load_secret
from .links import HWM, Inbound, KeyList, close_dealer, handshake_events, limit, open_dealer, secret_file
from .liveness import AUTH_FAILED, GONE, JOINING, MISSING, NODE_ID_CONFLICT, UP, Cadence, Liveness
from .membership import Listed, Listing, Membership, split_endpoint
from .peer_state import PeerState, peer_row, unkeyed_row

log = logging.getLogger("mmfeatd.mesh")

ZAP_DOMAIN = "mmfeat-mesh"
HANDSHAKE_MS = 3000
# libzmq does not reconnect after a peer refused our key; the peer's list may be fixed (and the peer
# restarted) meanwhile, so the DEALER connects again this often, each attempt counted.
AUTH_RETRY_S = 5.0
# How long a daemon's start waits for the first read of a source other than the static list.
FIRST_READ_S = 5.0
# Requests held per peer until its hello arrives: what one DEALER can have queued, as above, and no more
# bytes of frames than this (held as frames, so a listed peer cannot make the daemon hold more).
MAX_EARLY = HWM
MAX_EARLY_BYTES = 4 << 20

HelloBody = Callable[[], dict[str, Any]]


class PeerHandler(Protocol):
    """What the mesh hands on: requests and replies about features, and peers coming and going."""

    def on_request(self, peer: "PeerState", op: str, body: Any, now: float) -> Optional[tuple[str, dict[str, Any]]]: ...

    def on_reply(self, peer: "PeerState", op: str, body: Any, now: float) -> None: ...

    def on_peer_change(self, peer: "PeerState", now: float) -> None: ...

    def on_peer_forgotten(self, key: str) -> None: ...


class Mesh:
    def __init__(self, ctx: zmq.Context, settings: Settings, hello_body: HelloBody, is_ours: IsOurs) -> None:
        try:
            public, secret = load_secret(secret_file(settings))
        except KeyFileError as exc:
            raise MeshConfigError(str(exc)) from None
        self._ctx = ctx
        self._public, self._secret = public, secret
        self.listen = settings.listen
        self.node_id = settings.node_id
        self.public_key = public.decode()
        self.cadence = Cadence.of(settings)
        self._hello_body = hello_body
        if self.public_key in {p.public_key for p in settings.peers}:
            raise MeshConfigError("peers lists this node's own public key; list the other nodes only")
        self.bad_messages = 0
        self.handler: Optional[PeerHandler] = None
        self.peers: dict[str, PeerState] = {}  # by public key: the listed peers with a key
        self.unkeyed: tuple[Listed, ...] = ()  # listed without a key: refused, shown in stats
        self.removed: dict[str, PeerState] = {}  # no longer listed: in stats as gone until forgotten
        self.generation = 0  # changes whenever sockets() does: the loop's poller is then made again
        self._addresses: frozenset[str] = frozenset()  # the listed peers', favoured on a full listener
        self.membership = Membership(settings, self.public_key)
        self._keys = KeyList(frozenset())  # ZAP asks with Z85 text
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("mmfeatd.mesh.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self._keys)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.zap_domain = ZAP_DOMAIN.encode()
        self.router.curve_server = True
        self.router.curve_secretkey, self.router.curve_publickey = secret, public
        self.router.ipv6 = settings.listen.startswith("tcp://[")
        # A connection that has not finished the CURVE handshake is dropped after this (libzmq's default
        # is 30 s): a stranger on the network holds an fd here for moments, not half a minute.
        self.router.handshake_ivl = HANDSHAKE_MS
        limit(self.router)
        self._inbound = Inbound(split_endpoint(settings.listen)[1], is_ours)
        # Strangers on the network can connect (CURVE only keeps them from saying anything): a flood of
        # connections is shed as on the control socket, before it can exhaust fds and abort libzmq.
        # A flood from elsewhere cannot keep out a peer that connects from an address its endpoint names.
        self._cap = ConnectionCap(ctx, "mesh listener", _cap_for(len(settings.peers)), is_ours,
                                  "Firewall listen to the cluster's nodes",
                                  favoured=lambda s: _plain(s.getpeername()[0]) in self._addresses)
        self._cap.watch(self.router)
        # Listed before the listener opens: it would refuse every peer's key while it knew none, and a
        # refused DEALER waits AUTH_RETRY_S before it tries again. A source slower than FIRST_READ_S to
        # answer (a resolver that does not) is applied when it does.
        self.membership.start()
        self.membership.first_read.wait(FIRST_READ_S)
        listing = self.membership.take()
        if listing is not None:
            self.apply(listing, time.monotonic())
        try:
            self.router.bind(settings.listen)
        except zmq.ZMQError as exc:
            self.close()
            raise MeshConfigError(f"cannot listen on {settings.listen}: {exc}") from None
        log.info("mesh: listening on %s as %s; peers from %s (%d now)", settings.listen, self.public_key,
                 settings.peers_from, len(self.peers))

    @property
    def refused(self) -> int:
        return self._keys.refused

    def sockets(self) -> list[zmq.Socket]:
        return [self.router, *(p.dealer for p in self.peers.values())]

    # --- who is listed --------------------------------------------------------------------------

    def apply(self, listing: Listing, now: float) -> None:
        """Make the peers what the source lists now: new ones added and probed at once, the ones it no
        longer lists (or lists with another key) removed with their connections."""
        wanted = {e.public_key: e for e in listing.peers if e.public_key is not None}
        if len(wanted) > MAX_PEERS:
            log.error("mesh: the source lists %d peers; only the first %d are used", len(wanted), MAX_PEERS)
            wanted = dict(list(wanted.items())[:MAX_PEERS])
        # The key set first: a handshake of a removed key from now on is refused, so that ending its
        # connections below ends them for good.
        self._keys.allowed = frozenset(k.encode() for k in wanted)
        self._addresses = listing.addresses
        self._cap.max_connections = _cap_for(len(wanted))
        for key in [k for k in self.peers if k not in wanted]:
            self._remove(self.peers[key], now)
        for key, entry in wanted.items():
            peer = self.peers.get(key)
            if peer is None:
                self._add(entry, now)
                continue
            peer.listed_as = entry.name
            if peer.config.endpoint != entry.endpoint:
                self._move(peer, entry.endpoint)
        self.unkeyed = tuple(e for e in listing.peers if e.public_key is None)

    def _add(self, entry: Listed, now: float) -> None:
        assert entry.public_key is not None
        try:
            config = Peer(endpoint=entry.endpoint, public_key=entry.public_key)
        except ValidationError:
            log.error("mesh: %s (%s) is not a peer this daemon can connect to; left out", entry.name, entry.endpoint)
            return
        self.removed.pop(entry.public_key, None)
        dealer, monitor = open_dealer(self._ctx, entry.endpoint, entry.public_key, self._public, self._secret)
        peer = PeerState(config, dealer, monitor, self.membership.source, entry.name, Liveness(changed_at=now))
        self.peers[entry.public_key] = peer
        self.generation += 1
        self._send(peer, "hello", self._hello_body())  # queued until the connection is up
        if self.membership.source != "static":
            log.info("mesh: peer %s (%s) added by its source", entry.name, entry.endpoint)

    def _remove(self, peer: PeerState, now: float) -> None:
        """The source no longer lists ``peer``: its sockets close, its connections to us end, and what
        waits on it fails now."""
        key = peer.config.public_key
        del self.peers[key]
        close_dealer(peer.dealer, peer.monitor)
        peer.monitor = None
        self.generation += 1
        ended = self._inbound.end(key)
        peer.live.set(GONE, now)
        peer.hello, peer.rtt_s = None, None
        self._drop_early(peer)
        self.removed[key] = peer
        log.warning("mesh: peer %s (%s) is no longer listed by its source (peers_from = %s): removed, %d of its "
                    "connections ended", peer.listed_as, peer.config.endpoint, peer.source, ended)
        if self.handler is not None:
            self.handler.on_peer_change(peer, now)

    def _move(self, peer: PeerState, endpoint: str) -> None:
        """The same key at another endpoint: the DEALER connects there instead."""
        try:
            peer.dealer.disconnect(peer.config.endpoint)
        except zmq.ZMQError:
            pass  # libzmq dropped the endpoint already
        peer.config = Peer(endpoint=endpoint, public_key=peer.config.public_key)
        peer.dealer.ipv6 = endpoint.startswith("tcp://[")
        peer.dealer.connect(endpoint)
        log.info("mesh: peer %s moved to %s", peer.listed_as, endpoint)

    # --- what comes in --------------------------------------------------------------------------

    def on_events(self, now: float) -> None:
        """Read everything waiting on the mesh sockets."""
        for _ in range(256):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._from_router(frames, now)
        for peer in self.peers.values():
            for _ in range(64):
                try:
                    frames = peer.dealer.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._from_dealer(peer, frames, now)

    def _from_router(self, frames: list[zmq.Frame], now: float) -> None:
        # The sender is the key it proved in the CURVE handshake (ZAP's User-Id), nothing it claims.
        key = (frames[-1].get("User-Id") or "") if frames else ""
        peer = self.peers.get(key)
        if peer is None:
            self.bad_messages += 1
            if key:  # a key no longer listed, whose handshake passed before it was taken away
                self._inbound.end_frame(frames[-1])
            return
        self._inbound.seen(key, frames[-1])
        if len(frames) != 2:
            self.bad_messages += 1
            return
        try:
            op, body = decode_mesh(frames[1].bytes)
        except MeshError as exc:
            self._bad(peer, str(exc))
            return
        if op not in MESH_REQUESTS:
            self._bad(peer, f"{op} is not sent to a listener")
            return
        if isinstance(body, MeshHello) and body.node == self.node_id:
            self._conflict(peer, body.node, now)
        elif isinstance(body, MeshHello) and peer.conflict is not None:
            peer.conflict = None  # renamed: welcome, and a later clash is logged again
            peer.logged.discard("conflict")
        back = self._seen(peer, now, notify=not isinstance(body, MeshHello))
        identity = frames[0].bytes
        if isinstance(body, MeshHello) and peer.conflict is not None:
            pass  # refused: its features would carry our name, and every get of ours would go to it
        elif isinstance(body, MeshHello):
            changed = (back or peer.hello is None or peer.hello.epoch != body.epoch
                       or peer.hello.nixl != body.nixl)
            if peer.hello is not None and peer.hello.epoch != body.epoch:
                log.warning("mesh: peer %s (%s) restarted: epoch %d -> %d", body.node, peer.config.endpoint,
                            peer.hello.epoch, body.epoch)
            peer.hello = body
            if changed and self.handler is not None:
                self.handler.on_peer_change(peer, now)
            early, peer.early, peer.early_bytes = peer.early, [], 0
            for held_identity, frame in early:
                self._request(peer, held_identity, *decode_mesh(frame), now)  # valid when it was held
        elif isinstance(body, MeshPing):
            self._reply(identity, encode_mesh("pong", {"seq": body.seq, "need_hello": peer.hello is None}))
        elif peer.hello is None:
            self._hold(peer, identity, op, frames[1].bytes)
        else:
            self._request(peer, identity, op, body, now)

    def _request(self, peer: PeerState, identity: bytes, op: str, body: Any, now: float) -> None:
        if self.handler is not None:
            reply = self.handler.on_request(peer, op, body, now)
            if reply is not None:
                self._reply(identity, encode_mesh(*reply))

    def _hold(self, peer: PeerState, identity: bytes, op: str, frame: bytes) -> None:
        """A request from a peer whose hello this daemon lacks: kept until the hello, which is asked for
        now rather than at the peer's next ping (a pong with an unknown seq only asks)."""
        if (peer.conflict is not None or len(peer.early) >= MAX_EARLY
                or peer.early_bytes + len(frame) > MAX_EARLY_BYTES):
            self._bad(peer, f"{op} before hello, past what is held")
            return
        if not peer.early:
            self._reply(identity, encode_mesh("pong", {"seq": 0, "need_hello": True}))
        peer.early.append((identity, frame))
        peer.early_bytes += len(frame)

    def _drop_early(self, peer: PeerState) -> None:
        """The peer went down or clashed before its hello: what it asked is void, and counted."""
        for _ in peer.early:
            self._bad(peer, "a request held for a hello that never came")
        peer.early, peer.early_bytes = [], 0

    def _from_dealer(self, peer: PeerState, frames: list[bytes], now: float) -> None:
        try:
            if len(frames) != 1:
                raise MeshError(f"expected one frame, got {len(frames)}")
            op, body = decode_mesh(frames[0])
        except MeshError as exc:
            self._bad(peer, str(exc))
            return
        if op not in MESH_REPLIES:
            self._bad(peer, f"{op} is not a reply")
            return
        if not isinstance(body, MeshPong):
            self._seen(peer, now)
            if self.handler is not None and peer.hello is not None:
                self.handler.on_reply(peer, op, body, now)
            return
        sent = peer.sent_at.pop(body.seq, None)
        if sent is not None:
            peer.rtt_s = now - sent
        self._seen(peer, now)
        if body.need_hello:
            self._send(peer, "hello", self._hello_body())

    def _conflict(self, peer: PeerState, node: str, now: float) -> None:
        if peer.hello is not None and self.handler is not None:  # it was another node until now
            peer.hello = None
            self.handler.on_peer_change(peer, now)
        peer.conflict, peer.hello = node, None
        peer.live.set(NODE_ID_CONFLICT, now)
        self._drop_early(peer)
        self._log_once(peer, "conflict", "mesh: refused peer %s: it announces node_id %r, which is this node's own; "
                       "give every node its own node_id (cloned hosts share a host name)", peer.config.endpoint, node)

    def _log_once(self, peer: PeerState, problem: str, msg: str, *args: Any) -> None:
        if problem not in peer.logged:
            peer.logged.add(problem)
            log.error(msg, *args)

    def _seen(self, peer: PeerState, now: float, notify: bool = True) -> bool:
        """Something valid came from ``peer``. True if that brought it back (from missing or gone);
        ``notify``: then say so now if it is back as the incarnation it was (its hello kept), so that
        pulls go to it again. A hello says so itself."""
        peer.messages += 1
        if peer.conflict is not None:
            peer.live.last_seen = now
            peer.live.set(NODE_ID_CONFLICT, now)
            return False
        left = peer.live.heard(now)
        if left is None:
            return False
        log.info("mesh: peer %s (%s) is up%s", peer.name, peer.config.endpoint,
                 f" again after {left}" if left in (MISSING, GONE) else "")
        if notify and left == MISSING and peer.hello is not None and self.handler is not None:
            self.handler.on_peer_change(peer, now)
        return left in (MISSING, GONE)

    def _bad(self, peer: PeerState, why: str) -> None:
        self.bad_messages += 1
        if self.bad_messages & (self.bad_messages - 1) == 0:
            log.warning("mesh: refused a message from %s: %s (%d so far)", peer.config.endpoint, why, self.bad_messages)

    def _handshakes(self, peer: PeerState, now: float) -> None:
        """The DEALER's handshake events: a refused key is a state of the peer's, counted and logged once."""
        assert peer.monitor is not None
        for event in handshake_events(peer.monitor):
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                peer.auth_failures += 1
                peer.retry_at = now + AUTH_RETRY_S
                if peer.state != UP:
                    peer.live.set(AUTH_FAILED, now)
                self._log_once(peer, "auth", "mesh: peer %s refused this node's key (%s): list it in that node's "
                               "peers (or its source's keys), with this public key", peer.config.endpoint,
                               self.public_key)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and peer.state == AUTH_FAILED:
                peer.live.set(JOINING, now)
                peer.logged.discard("auth")

    def tick(self, now: float) -> None:
        """A new listing applied; probes out; peers that missed too many marked missing, then gone."""
        listing = self.membership.take()
        if listing is not None:
            self.apply(listing, now)
        for peer in list(self.peers.values()):
            if peer.monitor is not None:
                self._handshakes(peer, now)
            if peer.retry_at and now >= peer.retry_at:
                peer.retry_at = 0.0
                try:
                    peer.dealer.disconnect(peer.config.endpoint)
                except zmq.ZMQError:
                    pass  # libzmq dropped the endpoint already
                peer.dealer.connect(peer.config.endpoint)
            if peer.live.probe(now, self.cadence):
                peer.seq += 1
                window = self.cadence.missing_after_s
                peer.sent_at = {s: t for s, t in peer.sent_at.items() if now - t < window}
                peer.sent_at[peer.seq] = now
                self._send(peer, "ping", {"seq": peer.seq})
            change = peer.live.due(now, self.cadence)
            if change == MISSING:
                self._missing(peer, now)
            elif change == GONE:
                self._forget(peer, now)
        for key, peer in list(self.removed.items()):
            if now - peer.live.changed_at >= self.cadence.forget_after_s:
                del self.removed[key]
                if self.handler is not None:
                    self.handler.on_peer_forgotten(key)

    def _missing(self, peer: PeerState, now: float) -> None:
        """No pulls or acks go to ``peer`` and what waits on it fails; who it was is kept."""
        peer.live.set(MISSING, now)
        peer.rtt_s = None
        log.warning("mesh: peer %s (%s) left %d probes in a row unanswered: missing, nothing goes to it until it "
                    "answers", peer.name, peer.config.endpoint, peer.live.misses)
        if self.handler is not None:
            self.handler.on_peer_change(peer, now)

    def _forget(self, peer: PeerState, now: float) -> None:
        """Missing for forget_after_s: its incarnation is dropped; if it answers again it says hello anew."""
        peer.live.set(GONE, now)
        peer.hello = None
        self._drop_early(peer)
        log.warning("mesh: peer %s was missing for %g s: forgotten; still listed, so still probed",
                    peer.config.endpoint, self.cadence.forget_after_s)
        if self.handler is not None:
            self.handler.on_peer_change(peer, now)

    def _send(self, peer: PeerState, op: str, body: dict[str, Any]) -> None:
        self.send(peer, op, body)  # heartbeats and hellos are not worth queueing beyond the HWM

    def send(self, peer: PeerState, op: str, body: dict[str, Any]) -> bool:
        """A request to ``peer`` on its DEALER; False if it cannot be queued (not connected, not reading)."""
        try:
            peer.dealer.send(encode_mesh(op, body), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def peer_for_node(self, node: str) -> Optional[PeerState]:
        """The peer that is up and said it is ``node``."""
        return next((p for p in self.peers.values()
                     if p.state == UP and p.hello is not None and p.hello.node == node), None)

    def _reply(self, identity: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def stats(self, now: Optional[float] = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        # Quorum: this node and the peers up, of this node and every peer its source lists (those
        # without a key too: they are members nobody can reach).
        members = 1 + len(self.peers) + len(self.unkeyed)
        reachable = 1 + sum(p.state == UP for p in self.peers.values())
        return {
            "listen": self.listen,
            "public_key": self.public_key,
            "refused": self.refused,
            "bad_messages": self.bad_messages,
            "connections": self._cap.connections,
            "connections_refused": self._cap.refused,
            "connections_evicted": self._cap.evicted,  # strangers' connections shut down for a listed peer's
            "connections_ended": self._inbound.ended,  # a removed key's connections, shut down
            "source": self.membership.stats(now),
            "liveness": {"probe_interval_s": self.cadence.probe_interval_s, "miss_limit": self.cadence.miss_limit,
                         "forget_after_s": self.cadence.forget_after_s},
            "quorum": {"members": members, "reachable": reachable, "ok": 2 * reachable > members},
            "peers": [peer_row(p, now) for p in (*self.peers.values(), *self.removed.values())]
            + [unkeyed_row(e, self.membership.source) for e in self.unkeyed],
        }

    def fabric_handle(self, public_key: str, pool: int) -> Optional[bytes]:
        """The FABRIC handle bytes a peer that is up announced for ``pool``, if any."""
        peer = self.peers.get(public_key)
        if peer is None or peer.state != UP or peer.hello is None:
            return None
        return next((p.fabric for p in peer.hello.pools if p.pool == pool), None)

    def close(self) -> None:
        self.membership.close()
        for peer in self.peers.values():
            close_dealer(peer.dealer, peer.monitor)
        self._cap.unwatch(self.router)
        self.router.close(0)
        self._cap.close()
        self._auth.stop()


def _cap_for(peers: int) -> int:
    """Connections the listener keeps: a few per peer (each reconnects now and then), and some room."""
    return 4 * peers + 16


def _plain(ip: str) -> str:
    return ip[len("::ffff:"):] if ip.startswith("::ffff:") else ip  # an IPv4 peer seen by a dual-stack listener
