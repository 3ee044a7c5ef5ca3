"""Two nodes on one machine as two machines would be: two network namespaces joined by a veth pair
(or more nodes, each joined by a veth to a bridge in a namespace of its own).

Two daemons of one host pull through cross-memory attach, whatever the mesh's addresses: UCX sees one
node (the processes share PID and IPC namespaces and the boot id). In namespaces of their own, with
UCX_TLS=tcp (TCP_ENV), the feature bytes cross the veth as they would cross a network without RDMA.
``mmfeat bench --remote --netns`` and the tests use this; it needs root and iproute2's ``ip``.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Each namespace has its own address space: the same /30 in every pair conflicts with nothing.
ADDRS = ("10.77.0.1", "10.77.0.2")
# Without it UCX still picks cross-memory attach between the namespaces; the device is left to the
# daemon, which finds the interface of its listen address.
TCP_ENV = {"UCX_TLS": "tcp"}
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2


@dataclass(frozen=True)
class NetnsPair:
    """Namespaces ``ns`` (one per node), joined by a veth named ``veth`` at both ends (one
    UCX_NET_DEVICES serves both), with ``addrs[i]`` in ``ns[i]``; no default route, so traffic goes
    only between them. With more than two nodes, each node's ``veth`` leads to a bridge in namespace
    ``hub``."""

    ns: tuple[str, ...]
    veth: str
    addrs: tuple[str, ...]
    hub: Optional[str] = None

    def etc(self, i: int) -> Path:
        """Files here replace those of /etc for what runs in namespace ``i`` (``ip netns exec`` mounts
        each over its namesake as it starts the command): a ``hosts`` of its own, say."""
        return Path("/etc/netns") / self.ns[i]

    def prefix(self, i: int) -> list[str]:
        """A command prefix that runs the rest in namespace ``i``. ``ip netns exec`` execs without
        forking: the process Popen starts is the command itself, with the caller's environment."""
        return ["ip", "netns", "exec", self.ns[i]]

    def enter(self, i: int) -> None:
        """Move the calling process (single-threaded, as a fresh worker is) into namespace ``i`` as ``ip
        netns exec`` does, with TCP_ENV and the veth as its UCX devices for any NIXL agent it makes.
        Besides the network namespace, a mount namespace of its own with /sys mounted afresh: UCX
        finds network devices in /sys/class/net, which otherwise still lists the host's."""
        libc = ctypes.CDLL(None, use_errno=True)

        def check(rc: int, what: str) -> None:
            if rc != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"{what} for namespace {self.ns[i]}: {os.strerror(err)}")

        fd = os.open(f"/run/netns/{self.ns[i]}", os.O_RDONLY)
        try:
            check(libc.setns(fd, _CLONE_NEWNET), "setns")
        finally:
            os.close(fd)
        check(libc.unshare(_CLONE_NEWNS), "unshare")
        check(libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
        check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
        check(libc.mount(self.ns[i].encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")
        os.environ.update(TCP_ENV, UCX_NET_DEVICES=self.veth)

    def veth_bytes(self, i: int) -> tuple[int, int]:
        """(rx, tx) bytes of namespace ``i``'s end of the veth."""
        stats = json.loads(_ip("-n", self.ns[i], "-s", "-j", "link", "show", self.veth))[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]


def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def _remove_stale(prefix: str) -> None:
    """Namespaces ``prefix``-PID-TAG left by a process that was killed before it removed them."""
    try:
        names = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == prefix and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def make_pair(prefix: str = "mmfb") -> NetnsPair:
    """Two namespaces and a veth, up and able to connect; OSError saying what failed if they cannot be
    made (not root, no ``ip``), after removing whatever part of them was."""
    return make_nodes(prefix, 2)


def make_nodes(prefix: str, n: int) -> NetnsPair:
    """``n`` namespaces able to connect to each other: two joined by a veth, more by a bridge."""
    _remove_stale(prefix)
    tag = secrets.token_hex(3)
    base = f"{prefix}-{os.getpid()}-{tag}"
    ns = tuple(f"{base}{chr(ord('a') + i)}" for i in range(n))
    if n == 2:
        pair = NetnsPair(ns, f"mmv{tag}", ADDRS)
    else:
        pair = NetnsPair(ns, f"mmv{tag}", tuple(f"10.77.0.{i + 1}" for i in range(n)), f"{base}h")
    try:
        for name in ns + ((pair.hub,) if pair.hub else ()):
            _ip("netns", "add", name)
        if pair.hub is None:
            _ip("link", "add", pair.veth, "netns", ns[0], "type", "veth", "peer", "name", pair.veth, "netns", ns[1])
        else:
            _ip("-n", pair.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", pair.hub, "link", "set", "br0", "up")
            for i, name in enumerate(ns):
                end = f"{pair.veth}{i}"
                _ip("link", "add", pair.veth, "netns", name, "type", "veth", "peer", "name", end, "netns", pair.hub)
                _ip("-n", pair.hub, "link", "set", end, "master", "br0")
                _ip("-n", pair.hub, "link", "set", end, "up")
        mask = "30" if pair.hub is None else "24"
        for name, addr in zip(ns, pair.addrs):
            _ip("-n", name, "addr", "add", f"{addr}/{mask}", "dev", pair.veth)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", pair.veth, "up")
        _wait_until_connects(pair)
    except BaseException:
        remove_pair(pair)
        raise
    return pair


def _wait_until_connects(pair: NetnsPair, timeout: float = 20.0) -> None:
    """A veth takes about a second after ``link set up`` before a connect across it succeeds."""
    # A refused connect is an answer from the other end: the link carries packets.
    probe = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 9), 0.5).close()\n"
             "except ConnectionRefusedError:\n    pass\n")
    deadline = time.monotonic() + timeout
    for i, addr in enumerate(pair.addrs):
        src = 1 if i == 0 else 0  # every node from another: the first from the second, the rest from the first
        while True:
            r = subprocess.run([*pair.prefix(src), sys.executable, "-c", probe, addr], capture_output=True,
                               timeout=60)
            if r.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise OSError(f"{pair.ns[src]} could not reach {addr} in {pair.ns[i]} within {timeout:g} s")
            time.sleep(0.1)


def remove_pair(pair: NetnsPair) -> None:
    """Delete the namespaces (the veths go with them) and their /etc/netns files; each tried whatever
    happened to the others."""
    for ns in pair.ns + ((pair.hub,) if pair.hub else ()):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    for i in range(len(pair.ns)):
        shutil.rmtree(pair.etc(i), ignore_errors=True)
