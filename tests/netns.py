"""Two nodes on one machine as two machines would be: each daemon in a network namespace of its own,
the pair joined by a veth, NIXL's UCX forced onto TCP. Without this, two daemons of one host pull
through cross-memory attach (UCX sees one node: same PID and IPC namespaces, same boot id), and no
test would see the TCP data plane. Needs root and iproute2; the fixture skips with the reason
otherwise. Also: which TCP sockets a process listens on."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

_PREFIX = "mmft"  # namespaces of these tests: mmft-<pid of the pytest that made them>-<random>
_SUBNET = ("10.77.0.1", "10.77.0.2")  # a /30 of the pair's own; each namespace has its own address space


@dataclass(frozen=True)
class NetnsPair:
    """Namespaces ``ns`` (one per node), joined by a veth named ``veth`` at both ends (one UCX_NET_DEVICES
    serves both), with ``addrs[i]`` in ``ns[i]``. No default route: traffic goes only between the two."""

    ns: tuple[str, str]
    veth: str
    addrs: tuple[str, str]

    def prefix(self, i: int) -> list[str]:
        """Run a command in namespace ``i``: ``ip netns exec`` execs without forking, so the process that
        Popen starts is the command itself, with the caller's environment."""
        return ["ip", "netns", "exec", self.ns[i]]

    def veth_bytes(self, i: int) -> tuple[int, int]:
        """(rx, tx) bytes of namespace ``i``'s end of the veth."""
        out = _ip("-n", self.ns[i], "-s", "-j", "link", "show", self.veth)
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]


def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def _remove_stale() -> None:
    """Namespaces left by a pytest that was killed before its teardown ran."""
    try:
        names = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == _PREFIX and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def make_pair() -> NetnsPair:
    """Two namespaces and a veth, up and able to connect; OSError (with what failed) if they cannot be
    made, after removing whatever part of them was."""
    _remove_stale()
    tag = secrets.token_hex(3)
    pair = NetnsPair((f"{_PREFIX}-{os.getpid()}-{tag}a", f"{_PREFIX}-{os.getpid()}-{tag}b"), f"mmv{tag}", _SUBNET)
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
    """Delete both namespaces (the veth goes with them); every step tried, whatever failed before."""
    for ns in pair.ns:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def tcp_listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, read from /proc: the sockets of its fds,
    found in its own network namespace's tcp and tcp6 tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: TCP_LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc prints the address as host-order 32-bit words.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.add((str(ipaddress.ip_address(raw)) if family == socket.AF_INET6 else socket.inet_ntoa(raw),
                         int(hex_port, 16)))
    return out


@pytest.fixture
def netns_pair():
    """A NetnsPair for one test, always removed afterwards; skipped with the reason where it cannot be made."""
    try:
        pair = make_pair()
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"two network namespaces joined by a veth cannot be made here (needs root and iproute2): {exc}")
    try:
        yield pair
    finally:
        remove_pair(pair)
