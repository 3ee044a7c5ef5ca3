"""The mesh: this daemon's links to the daemons of other nodes, over ZeroMQ CURVE on tcp://.

A ROUTER on ``listen`` takes the peers' DEALERs; a DEALER per listed peer goes the other way. CURVE
encrypts both and a ZAP handler lets in only the listed public keys (each refusal is counted), so a
message's sender is known by the key it proved, never by what it says. Each side sends a hello (node,
epoch, pools with their FABRIC handle bytes) when it connects and whenever the other asks for it, and
a ping every HEARTBEAT_S; a peer silent for DOWN_AFTER_S is marked down and what it said is dropped.
A request that arrives before the sender's hello (this daemon restarted, or marked the sender down
while it, or this daemon, was frozen) is held until the hello comes, which it is asked for at once:
the sender cannot know it was not heard, and its acks would otherwise be lost.
Two conditions that would otherwise look like a peer forever ``connecting`` or a mesh of STALE answers
are states of their own, logged once per peer: ``auth_failed`` (the peer's ZAP refused our key, which
a monitor of our DEALER reports) and ``node_id_conflict`` (the peer announces our own node id).

This is the membership layer; what travels over it for features (checks after pulls, relayed acks,
ended notices) is daemon/mesh/remote.py's, which the mesh hands every other request and reply to. Every
frame is untrusted input: validated by protos.mesh, counted when bad, never a crash.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from mmfeat.protos.mesh import (
    MAX_MESH_FRAME, MESH_REPLIES, MESH_REQUESTS, MeshError, MeshHello, MeshPing, MeshPong, decode_mesh, encode_mesh,
)

from ..config import MeshConfigError, Peer, Settings
from ..sockets.connection_cap import ConnectionCap, IsOurs
from .keys import SECRET_FILE, KeyFileError, credential, load_secret

log = logging.getLogger("mmfeatd.mesh")

HEARTBEAT_S = 1.0
DOWN_AFTER_S = 3.5  # three heartbeats missed, and a little slack
ZAP_DOMAIN = "mmfeat-mesh"
HANDSHAKE_MS = 3000
# libzmq does not reconnect after a peer refused our key; the peer's list may be fixed (and the peer
# restarted) meanwhile, so the DEALER connects again this often, each attempt counted.
AUTH_RETRY_S = 5.0
# Messages queued per peer and direction: heartbeats, checks and ack batches; a peer that does not
# read loses what is past this (a check then times out, acks fall to the owner's ack_ttl).
_HWM = 1024
# Requests held per peer until its hello arrives: what one DEALER can have queued, as above, and no more
# bytes of frames than this (held as frames, so a listed peer cannot make the daemon hold more).
MAX_EARLY = _HWM
MAX_EARLY_BYTES = 4 << 20

HelloBody = Callable[[], dict[str, Any]]


class PeerHandler(Protocol):
    """What the mesh hands on: requests and replies about features, and peers coming and going."""

    def on_request(self, peer: "PeerState", op: str, body: Any, now: float) -> Optional[tuple[str, dict[str, Any]]]: ...

    def on_reply(self, peer: "PeerState", op: str, body: Any, now: float) -> None: ...

    def on_peer_change(self, peer: "PeerState", now: float) -> None: ...


@dataclass
class PeerState:
    config: Peer
    dealer: zmq.Socket
    monitor: Optional[zmq.Socket] = None  # the DEALER's handshake events
    state: str = "connecting"  # connecting (never heard from), up, down, auth_failed, node_id_conflict
    hello: Optional[MeshHello] = None
    last_seen: float = 0.0
    next_ping: float = 0.0
    seq: int = 0
    sent_at: dict[int, float] = field(default_factory=dict)
    rtt_s: Optional[float] = None
    messages: int = 0
    auth_failures: int = 0  # handshakes the peer refused our key in
    retry_at: float = 0.0  # when to connect again after a refusal; 0: not waiting to
    conflict: Optional[str] = None  # the node id it announced, when that is ours: nothing it says counts
    logged: set[str] = field(default_factory=set)  # problems logged already, so each is logged once
    # Requests (connection to answer on, frame) that came before its hello, in order: handled once it
    # says who it is now (its epoch decides what they void), dropped if it goes down first.
    early: list[tuple[bytes, bytes]] = field(default_factory=list)
    early_bytes: int = 0


class _KeyList:
    """The ZAP handler's question: is this public key a listed peer? Runs on the authenticator's thread."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, 8, ...: a scanner cannot flood the log
            log.warning("mesh: refused a connection with an unlisted public key (%d so far); add it to peers if "
                        "it is one of ours", self.refused)
        return False


def secret_file(settings: Settings, environ: Optional[dict[str, str]] = None) -> Path:
    """Where this node's secret key is: the setting (which a config file's directory fills in), else
    what systemd handed over in its credentials directory."""
    if settings.mesh_secret_file is not None:
        return settings.mesh_secret_file
    environ = os.environ if environ is None else environ
    handed = credential(environ)
    if handed is not None:
        return handed
    if environ.get("CREDENTIALS_DIRECTORY"):
        return Path(environ["CREDENTIALS_DIRECTORY"]) / SECRET_FILE
    raise MeshConfigError("listen is set but no mesh secret key is: run mmfeatd --gen-keys DIR in the config "
                          "file's directory, set mesh_secret_file, or under systemd install deploy/mmfeatd-mesh.conf "
                          "as the unit's drop-in (LoadCredential=mesh.secret:PATH)")


class Mesh:
    def __init__(self, ctx: zmq.Context, settings: Settings, hello_body: HelloBody, is_ours: IsOurs) -> None:
        try:
            public, secret = load_secret(secret_file(settings))
        except KeyFileError as exc:
            raise MeshConfigError(str(exc)) from None
        self.listen = settings.listen
        self.node_id = settings.node_id
        self.public_key = public.decode()
        self._hello_body = hello_body
        if self.public_key in {p.public_key for p in settings.peers}:
            raise MeshConfigError("peers lists this node's own public key; list the other nodes only")
        self._keys = _KeyList({p.public_key.encode() for p in settings.peers})  # ZAP asks with Z85 text
        self.bad_messages = 0
        self.handler: Optional[PeerHandler] = None
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("mmfeatd.mesh.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self._keys)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.zap_domain = ZAP_DOMAIN.encode()
        self.router.curve_server = True
        self.router.curve_secretkey, self.router.curve_publickey = secret, public
        # A connection that has not finished the CURVE handshake is dropped after this (libzmq's default
        # is 30 s): a stranger on the network holds an fd here for moments, not half a minute.
        self.router.handshake_ivl = HANDSHAKE_MS
        self._limit(self.router)
        # Strangers on the network can connect (CURVE only keeps them from saying anything): a flood of
        # connections is shed as on the control socket, before it can exhaust fds and abort libzmq.
        # A flood from elsewhere cannot keep out a peer that connects from an address its endpoint names.
        addresses = peer_addresses(settings.peers)
        self._cap = ConnectionCap(ctx, "mesh listener", 4 * len(settings.peers) + 16, is_ours,
                                  "Firewall listen to the cluster's nodes",
                                  favoured=lambda s: _address(s.getpeername()[0]) in addresses)
        self._cap.watch(self.router)
        try:
            self.router.bind(settings.listen)
        except zmq.ZMQError as exc:
            self.close()
            raise MeshConfigError(f"cannot listen on {settings.listen}: {exc}") from None
        self.peers: dict[str, PeerState] = {}
        for peer in settings.peers:
            dealer = ctx.socket(zmq.DEALER)
            dealer.curve_serverkey = peer.public_key.encode()
            dealer.curve_secretkey, dealer.curve_publickey = secret, public
            self._limit(dealer)
            # Without this, a peer whose ZAP refuses our key looks like one that never answers.
            monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            dealer.connect(peer.endpoint)
            state = PeerState(peer, dealer, monitor)
            self.peers[peer.public_key] = state
            self._send(state, "hello", hello_body())  # queued until the connection is up
        log.info("mesh: listening on %s as %s with %d peer(s)", settings.listen, self.public_key, len(self.peers))

    @staticmethod
    def _limit(sock: zmq.Socket) -> None:
        sock.linger = 0
        sock.maxmsgsize = MAX_MESH_FRAME
        sock.sndhwm = sock.rcvhwm = _HWM

    @property
    def refused(self) -> int:
        return self._keys.refused

    def sockets(self) -> list[zmq.Socket]:
        return [self.router, *(p.dealer for p in self.peers.values())]

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
        peer = self.peers.get(frames[-1].get("User-Id") or "") if frames else None
        if peer is None or len(frames) != 2:
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
        self._seen(peer, now)
        identity = frames[0].bytes
        if isinstance(body, MeshHello) and peer.conflict is not None:
            pass  # refused: its features would carry our name, and every get of ours would go to it
        elif isinstance(body, MeshHello):
            changed = peer.hello is None or peer.hello.epoch != body.epoch or peer.hello.nixl != body.nixl
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
        peer.conflict, peer.hello, peer.state = node, None, "node_id_conflict"
        self._drop_early(peer)
        self._log_once(peer, "conflict", "mesh: refused peer %s: it announces node_id %r, which is this node's own; "
                       "give every node its own node_id (cloned hosts share a host name)", peer.config.endpoint, node)

    def _log_once(self, peer: PeerState, problem: str, msg: str, *args: Any) -> None:
        if problem not in peer.logged:
            peer.logged.add(problem)
            log.error(msg, *args)

    def _seen(self, peer: PeerState, now: float) -> None:
        peer.last_seen = now
        peer.messages += 1
        if peer.conflict is not None:
            peer.state = "node_id_conflict"
        elif peer.state != "up":
            log.info("mesh: peer %s is up", peer.config.endpoint)
            peer.state = "up"

    def _bad(self, peer: PeerState, why: str) -> None:
        self.bad_messages += 1
        if self.bad_messages & (self.bad_messages - 1) == 0:
            log.warning("mesh: refused a message from %s: %s (%d so far)", peer.config.endpoint, why, self.bad_messages)

    def _handshakes(self, peer: PeerState, now: float) -> None:
        """The DEALER's handshake events: a refused key is a state of the peer's, counted and logged once."""
        for _ in range(64):
            try:
                event = recv_monitor_message(peer.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                peer.auth_failures += 1
                peer.retry_at = now + AUTH_RETRY_S
                if peer.state != "up":
                    peer.state = "auth_failed"
                self._log_once(peer, "auth", "mesh: peer %s refused this node's key (%s): list it in that node's "
                               "peers, with this public key", peer.config.endpoint, self.public_key)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and peer.state == "auth_failed":
                peer.state = "connecting"
                peer.logged.discard("auth")

    def tick(self, now: float) -> None:
        """Heartbeats out; peers silent for too long marked down and forgotten."""
        for peer in self.peers.values():
            if peer.monitor is not None:
                self._handshakes(peer, now)
            if peer.retry_at and now >= peer.retry_at:
                peer.retry_at = 0.0
                try:
                    peer.dealer.disconnect(peer.config.endpoint)
                except zmq.ZMQError:
                    pass  # libzmq dropped the endpoint already
                peer.dealer.connect(peer.config.endpoint)
            if now >= peer.next_ping:
                peer.seq += 1
                peer.sent_at = {s: t for s, t in peer.sent_at.items() if now - t < DOWN_AFTER_S}
                peer.sent_at[peer.seq] = now
                self._send(peer, "ping", {"seq": peer.seq})
                peer.next_ping = now + HEARTBEAT_S
            if peer.state == "up" and now - peer.last_seen > DOWN_AFTER_S:
                log.warning("mesh: peer %s (%s) stopped answering; marked down", peer.hello.node if peer.hello else "?",
                            peer.config.endpoint)
                peer.state, peer.hello, peer.rtt_s = "down", None, None
                self._drop_early(peer)
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
                     if p.state == "up" and p.hello is not None and p.hello.node == node), None)

    def _reply(self, identity: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def stats(self, now: Optional[float] = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        return {
            "listen": self.listen,
            "public_key": self.public_key,
            "refused": self.refused,
            "bad_messages": self.bad_messages,
            "connections": self._cap.connections,
            "connections_refused": self._cap.refused,
            "connections_evicted": self._cap.evicted,  # strangers' connections shut down for a listed peer's
            "peers": [
                {
                    "endpoint": p.config.endpoint,
                    "public_key": p.config.public_key,
                    "state": p.state,
                    "auth_failures": p.auth_failures,
                    "node": p.hello.node if p.hello else None,
                    "epoch": p.hello.epoch if p.hello else None,
                    "pools": [pool.model_dump(exclude={"fabric", "addr"})
                              | {"fabric": pool.fabric is not None, "pullable": pool.addr != 0}
                              for pool in p.hello.pools] if p.hello else [],
                    "fabric_domain": p.hello.fabric_domain.model_dump() if p.hello and p.hello.fabric_domain else None,
                    "rtt_ms": round(p.rtt_s * 1e3, 3) if p.rtt_s is not None else None,
                    "last_seen_s": round(now - p.last_seen, 3) if p.last_seen else None,
                }
                for p in self.peers.values()
            ],
        }

    def fabric_handle(self, public_key: str, pool: int) -> Optional[bytes]:
        """The FABRIC handle bytes a peer that is up announced for ``pool``, if any."""
        peer = self.peers.get(public_key)
        if peer is None or peer.state != "up" or peer.hello is None:
            return None
        return next((p.fabric for p in peer.hello.pools if p.pool == pool), None)

    def close(self) -> None:
        for peer in getattr(self, "peers", {}).values():
            if peer.monitor is not None:
                peer.dealer.disable_monitor()
                peer.monitor.close(0)
            peer.dealer.close(0)
        self._cap.unwatch(self.router)
        self.router.close(0)
        self._cap.close()
        self._auth.stop()


def peer_addresses(peers: list[Peer]) -> frozenset[str]:
    """The IP addresses the peers' endpoints name (host names resolved once, now): connections from them
    keep their place on a full mesh listener. A name that does not resolve is left out, with a warning."""
    out: set[str] = set()
    for p in peers:
        host = p.endpoint[len("tcp://"):].rsplit(":", 1)[0]
        try:
            out.update(_address(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        except OSError as exc:
            log.warning("mesh: cannot resolve peer %s (%s); a connection flood may keep it out", p.endpoint, exc)
    return frozenset(out)


def _address(ip: str) -> str:
    return ip[len("::ffff:"):] if ip.startswith("::ffff:") else ip  # an IPv4 peer seen by a dual-stack listener
