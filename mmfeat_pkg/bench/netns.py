"""Two nodes on one machine as two machines would be: two network namespaces joined by a veth pair.

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
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
    only between the two."""

    ns: tuple[str, str]
    veth: str
    addrs: tuple[str, str]

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
    _remove_stale(prefix)
    tag = secrets.token_hex(3)
    pair = NetnsPair((f"{prefix}-{os.getpid()}-{tag}a", f"{prefix}-{os.getpid()}-{tag}b"), f"mmv{tag}", ADDRS)
    try:
        for ns in pair.ns:
            _ip("netns", "add", ns)
        _ip("link", "add", pair.veth, "netns", pair.ns[0], "type", "veth",
            "peer", "name", pair.veth, "netns", pair.ns[1])
        for ns, addr in zip(pair.ns, pair.addrs):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", pair.veth)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", pair.veth, "up")
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
    while True:
        r = subprocess.run([*pair.prefix(0), sys.executable, "-c", probe, pair.addrs[1]], capture_output=True,
                           timeout=60)
        if r.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise OSError(f"the veth between {pair.ns[0]} and {pair.ns[1]} carried nothing within {timeout:g} s")
        time.sleep(0.1)


def remove_pair(pair: NetnsPair) -> None:
    """Delete both namespaces (the veth goes with them); each tried whatever happened to the other."""
    for ns in pair.ns:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
