"""Which network devices the NIXL agent's UCX may use, so that the data plane listens where the mesh does.

UCX's TCP transport opens a listening socket on every interface it is allowed (one per interface, on
that interface's address), whatever the mesh's ``listen`` says: a daemon meant for a private cluster
network would also take connections from any other network the node is on. Limiting UCX_NET_DEVICES to
the interface that owns ``listen``, plus the node's RDMA ports (which open no TCP socket), keeps RDMA
and GPUDirect where they exist and puts the TCP data plane on the mesh's network only.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import logging
import socket
from pathlib import Path
from typing import Mapping, Optional

from mmfeat.nixl import NixlUnavailable

from ..config import MeshConfigError

log = logging.getLogger("mmfeatd.mesh")

_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")
_INFINIBAND = Path("/sys/class/infiniband")


class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("next", ctypes.POINTER(_Ifaddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.POINTER(_Sockaddr)), ("netmask", ctypes.c_void_p),
                     ("ifu", ctypes.c_void_p), ("data", ctypes.c_void_p)]


def interface_addresses() -> dict[str, set[str]]:
    """Every interface of this network namespace with its IPv4 and IPv6 addresses (getifaddrs: the
    primary address and every secondary one, which SIOCGIFADDR would miss)."""
    libc = ctypes.CDLL(None, use_errno=True)  # libc is loaded already; find_library would fork ldconfig
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"getifaddrs: {os.strerror(err)}")
    out: dict[str, set[str]] = {}
    try:
        node = head
        while node:
            entry = node.contents
            name = entry.name.decode().split(":")[0]  # eth0:1, an IPv4 alias's label, is eth0 to UCX
            out.setdefault(name, set())
            family = entry.addr.contents.family if entry.addr else None
            if family == socket.AF_INET:
                out[name].add(socket.inet_ntop(socket.AF_INET, ctypes.string_at(entry.addr, 8)[4:8]))
            elif family == socket.AF_INET6:
                out[name].add(socket.inet_ntop(socket.AF_INET6, ctypes.string_at(entry.addr, 24)[8:24]))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return out


def rdma_ports() -> list[str]:
    """This node's RDMA ports as UCX names them (``mlx5_0:1``): kept usable when TCP is narrowed."""
    if not _INFINIBAND.is_dir():
        return []
    return sorted(f"{dev.name}:{port.name}" for dev in _INFINIBAND.iterdir() for port in (dev / "ports").glob("*")
                  if port.name.isdigit())


def listen_host(listen: str) -> str:
    """The ADDRESS of ``tcp://ADDRESS:PORT`` (brackets of an IPv6 literal removed)."""
    host = listen.removeprefix("tcp://").rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def interface_of(host: str, interfaces: Mapping[str, set[str]]) -> Optional[str]:
    """The interface that owns ``host`` (an interface name, as ZeroMQ accepts, an address, or a host
    name); None for a wildcard, which binds every interface. MeshConfigError when none owns it."""
    if host in _WILDCARDS:
        return None
    if host in interfaces:
        return host
    try:
        addresses = {str(ipaddress.ip_address(host))}
    except ValueError:
        try:
            addresses = {str(ipaddress.ip_address(info[4][0].split("%")[0]))
                         for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
        except (socket.gaierror, UnicodeError) as exc:
            raise MeshConfigError(f"listen names host {host!r}, which does not resolve ({exc}); name an address "
                                  f"of this node, or set data_devices") from None
    for name, owned in sorted(interfaces.items()):
        if addresses & {str(ipaddress.ip_address(a.split("%")[0])) for a in owned}:
            return name
    raise MeshConfigError(f"no interface of this node has listen's address {host!r} ({', '.join(sorted(addresses))}); "
                          f"name one of this node's addresses in listen, or the devices in data_devices")


def net_devices(listen: str, configured: str, environ: Mapping[str, str],
                interfaces: Optional[Mapping[str, set[str]]] = None, rdma: Optional[list[str]] = None) -> Optional[str]:
    """What UCX_NET_DEVICES the agent gets: the ``data_devices`` setting if set; else the environment's
    own UCX_NET_DEVICES (an operator's choice, left as it is: None); else the interface of ``listen``
    and every RDMA port; None with a wildcard ``listen`` (every interface, as the mesh itself)."""
    if configured:
        return configured
    if "UCX_NET_DEVICES" in environ:
        return None
    iface = interface_of(listen_host(listen), interface_addresses() if interfaces is None else interfaces)
    if iface is None:
        return None
    return ",".join([*(rdma_ports() if rdma is None else rdma), iface])


def choose_devices(listen: str, configured: str) -> Optional[str]:
    """net_devices for this daemon, logged; NixlUnavailable when listen's address has no interface."""
    try:
        devices = net_devices(listen, configured, os.environ)
    except MeshConfigError as exc:
        raise NixlUnavailable(f"the data plane has no interface to listen on: {exc}") from None
    if devices is None and "UCX_NET_DEVICES" not in os.environ:
        log.warning("mesh: listen %s is a wildcard: NIXL's UCX listens on every interface (set data_devices to "
                    "keep it on one)", listen)
    log.info("mesh: NIXL's UCX uses network devices %s", devices or os.environ.get("UCX_NET_DEVICES", "all"))
    return devices


def explain(exc: NixlUnavailable, devices: Optional[str]) -> NixlUnavailable:
    """NIXL's own error says only NIXL_ERR_BACKEND when no device it was given exists here."""
    used = devices or os.environ.get("UCX_NET_DEVICES")
    if not used or used == "all":
        return exc
    return NixlUnavailable(f"{exc} (UCX_NET_DEVICES={used}: a device this node lacks leaves UCX no transport; "
                           f"check data_devices)")
