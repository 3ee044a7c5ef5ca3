"""Nodes for mesh tests: CURVE keys made by mmfeatd's key generator, a port each, and daemons that list each
other as peers, all on 127.0.0.1; or, with a NetnsPair, each node in a network namespace of its own with
the data plane on TCP over the veths between them, as machines would be. A node may instead find its
peers in a source (``mesh=``): a directory of peer files and one of keys per node, made here."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import zmq

from mmfeat.bench.netns import TCP_ENV
from mmfeat.testing import free_tcp_port
from mmfeat.daemon.mesh import keys as mesh_keys
from mmfeat.daemon.mesh.keys import load_secret

from .conftest import Daemon, start_daemon
from .netns import NetnsPair, tcp_listeners


def _free_port() -> int:
    return free_tcp_port()


def _gen_keys(directory: Path) -> str:
    """A node's keypair, written by what ``mmfeatd --gen-keys`` runs (test_mesh runs the command itself):
    the mesh tests make about forty, and a daemon's start-up costs half a second of CPU each."""
    mesh_keys.generate(directory)
    return (directory / "mesh.public").read_text().strip()


class Cluster:
    """Nodes with keys and ports; ``start(name, peers)`` runs a daemon that lists those peers."""

    def __init__(self, root: Path, netns: NetnsPair | None = None) -> None:
        self.root = root
        self.netns = netns
        self.keys: dict[str, str] = {}
        self.ports: dict[str, int] = {}
        self.hosts: dict[str, str] = {}
        self.daemons: dict[str, Daemon] = {}
        self._veth_rx: dict[str, int] = {}

    def node(self, name: str, port: int | None = None) -> None:
        """``port``: the node's mesh port (in namespaces every node may have the same one)."""
        self.keys[name] = _gen_keys(self.root / f"keys-{name}")
        self.ports[name] = port or _free_port()
        if self.netns is None:
            self.hosts[name] = "127.0.0.1"
        else:
            assert len(self.hosts) < len(self.netns.addrs), f"the namespaces hold {len(self.netns.addrs)} nodes"
            self.hosts[name] = self.netns.addrs[len(self.hosts)]

    def keyring(self, name: str) -> Path:
        """``name``'s keys_dir: the other nodes' public keys it accepts, one file each."""
        path = self.root / f"keyring-{name}"
        path.mkdir(exist_ok=True)
        return path

    def trust(self, name: str, other: str, as_name: str | None = None) -> None:
        """``name`` accepts ``other``'s key, in a file named ``as_name`` (its address, for a dns source)."""
        (self.keyring(name) / (as_name or self.hosts[other])).write_text(self.keys[other] + "\n")

    def revoke(self, name: str, other: str, as_name: str | None = None) -> None:
        (self.keyring(name) / (as_name or self.hosts[other])).unlink()

    def peer_dir(self, name: str) -> Path:
        """``name``'s peers_dir: a peer file per node it meshes with."""
        path = self.root / f"peers-{name}"
        path.mkdir(exist_ok=True)
        return path

    def list_peer(self, name: str, other: str, key: bool = True) -> None:
        """A peer file for ``other`` in ``name``'s peers_dir: its endpoint, and its key unless ``key`` is
        False (then keys_dir must hold it)."""
        text = f'endpoint = "{self.endpoint(other)}"\n' + (f'public_key = "{self.keys[other]}"\n' if key else "")
        tmp = self.peer_dir(name) / f".{other}.tmp"
        tmp.write_text(text)
        tmp.rename(self.peer_dir(name) / f"{other}.toml")  # whole, as a ConfigMap update is

    def _ns_index(self, name: str) -> int:
        assert self.netns is not None
        return self.netns.addrs.index(self.hosts[name])

    def impersonate(self, ctx: zmq.Context, as_node: str, to_node: str) -> zmq.Socket:
        """A DEALER that holds ``as_node``'s secret key, connected to ``to_node``: an authenticated peer
        that can send anything at all."""
        public, secret = load_secret(self.root / f"keys-{as_node}" / "mesh.secret")
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.curve_serverkey = self.keys[to_node].encode()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.connect(self.endpoint(to_node))
        return sock

    def endpoint(self, name: str) -> str:
        return f"tcp://{self.hosts[name]}:{self.ports[name]}"

    def start(self, name: str, peers: list[str], *args: str, nofile: int | None = None, env: dict | None = None,
              backend: str = "host", runtime: Path | None = None, log: Path | None = None,
              mesh: dict[str, Any] | None = None) -> Daemon:
        """``runtime``: a runtime dir to reuse (a restart where clients wait); ``log``: stderr to a file;
        ``mesh``: settings for a [mesh] table (peers_from and the rest; with ``peers``, liveness for them)."""
        listed = ", ".join(f'{{endpoint = "{self.endpoint(p)}", public_key = "{self.keys[p]}"}}' for p in peers)
        config = self.root / f"{name}.toml"
        text = (f'[mmfeatd]\nnode_id = "{name}"\nlisten = "{self.endpoint(name)}"\n'
                f'mesh_secret_file = "{self.root / f"keys-{name}" / "mesh.secret"}"\n')
        if peers or mesh is None:
            text += f"peers = [{listed}]\n"
        if mesh is not None:
            text += "\n[mesh]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in mesh.items())
        config.write_text(text)
        runtime = runtime or Path(tempfile.mkdtemp(prefix=f"mmf-{name}-", dir="/tmp"))
        wrap: list[str] = []
        if self.netns is not None:
            # TCP_ENV: see mmfeat_pkg/bench/netns.py. Clients of the daemon need no namespace: its control
            # and fd sockets are Unix sockets with paths, reachable from any network namespace.
            env = {**TCP_ENV, **(env or {})}
            wrap = self.netns.prefix(self._ns_index(name))
            self._veth_rx.setdefault(name, self.netns.veth_bytes(self._ns_index(name))[0])
        d = start_daemon(runtime, "--config", str(config), "--pool-mb", "8", *args, nofile=nofile, env=env,
                         backend=backend, log=log, wrap=wrap)
        self.daemons[name] = d
        return d

    def check_data_plane(self, pulled_by: str, nbytes: int) -> None:
        """Every daemon's TCP listeners are on its node's address only (the mesh's and UCX's: no other
        interface); in namespaces, ``pulled_by``'s end of the veth received at least ``nbytes`` since its
        node started, so the pulls crossed the network and not cross-memory attach."""
        for name, d in self.daemons.items():
            listening = tcp_listeners(d.pid)
            assert (self.hosts[name], self.ports[name]) in listening, (name, listening)
            assert len(listening) >= 2, f"{name}: no NIXL/UCX listener next to the mesh's: {listening}"
            assert {addr for addr, _ in listening} == {self.hosts[name]}, f"{name} listens elsewhere: {listening}"
        if self.netns is not None:
            received = self.netns.veth_bytes(self._ns_index(pulled_by))[0] - self._veth_rx[pulled_by]
            assert received >= nbytes, f"{pulled_by} received {received} B over the veth, pulled {nbytes} B"

    def stop(self, name: str, sig: int = signal.SIGTERM, keep_runtime: bool = False) -> None:
        d = self.daemons.pop(name)
        if d.proc.poll() is None:
            d.proc.send_signal(sig)
        rc = d.proc.wait(15)
        _, err = d.proc.communicate()
        if not keep_runtime:
            shutil.rmtree(d.runtime_dir, ignore_errors=True)
        # A mesh daemon stops as cleanly as any: its ZAP thread, DEALERs and listener all close.
        assert sig != signal.SIGTERM or rc == 0, f"{name} exited {rc} on SIGTERM: {err[-2000:]}"


def _toml(value: Any) -> str:
    return f'"{value}"' if isinstance(value, (str, Path)) else repr(value)


def meshed(cluster: Cluster, *args: str, nodes: tuple[str, ...] = ("a", "b"), pool_mb: int = 160) -> list[Daemon]:
    """Daemons for ``nodes``, each listing all the others, once every one sees every peer up."""
    for n in nodes:
        cluster.node(n)
    daemons = [cluster.start(n, [m for m in nodes if m != n], "--pool-mb", str(pool_mb), *args) for n in nodes]
    for d in daemons:
        d.wait_for(lambda s: all(p["state"] == "up" and p["node"] for p in s["mesh"]["peers"]), timeout=60,
                   what="every peer up")
    return daemons


def idle(d: Daemon, what: str) -> dict:
    """Wait until ``d`` has nothing live and nothing used: every feature and every copy freed."""
    return d.wait_for(lambda s: s["pools"][0]["used"] == 0 and sum(s["leases"].values()) == 0, timeout=20, what=what)
