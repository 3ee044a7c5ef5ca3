"""The tests' side of mmfeat_pkg/bench/netns.py: fixtures with two network namespaces joined by a veth,
or three on a bridge, removed after the test, skipped with the reason where they cannot be made (needs
root and iproute2); each namespace's own /etc/hosts; and which TCP sockets a process listens on."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess

import pytest

from mmfeat.bench.netns import NetnsPair, make_nodes, remove_pair

__all__ = ["NetnsPair", "netns_pair", "netns_trio", "publish", "tcp_listeners"]

_PREFIX = "mmft"  # namespaces of these tests: mmft-<pid of the pytest that made them>-<random>


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


def publish(netns: NetnsPair, i: int, name: str, addrs: list[str]) -> None:
    """Namespace ``i``'s /etc/hosts names ``addrs`` ``name``, as a headless Service's DNS would: a daemon
    started there after this resolves it through the standard resolver. Written in place (the file is
    mounted over /etc/hosts by inode), each line whole in one write, so a reader never sees part of one."""
    hosts = netns.etc(i) / "hosts"
    if not hosts.exists():
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text("127.0.0.1 localhost\n")
    known = hosts.read_text().splitlines()
    with open(hosts, "a") as f:
        for addr in addrs:
            if f"{addr} {name}" not in known:
                f.write(f"{addr} {name}\n")
                f.flush()


def _nodes(n: int):
    try:
        pair = make_nodes(_PREFIX, n)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"{n} network namespaces that reach each other cannot be made here (needs root and iproute2): "
                    f"{exc}")
    try:
        yield pair
    finally:
        remove_pair(pair)


@pytest.fixture
def netns_pair():
    """A NetnsPair for one test, always removed afterwards; skipped with the reason where it cannot be made."""
    yield from _nodes(2)


@pytest.fixture
def netns_trio():
    """Three namespaces on a bridge, as netns_pair."""
    yield from _nodes(3)
