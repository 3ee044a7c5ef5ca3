"""Where the mesh's peers come from (``peers_from``), read again every ``peers_refresh_s``.

- ``static``: the ``peers`` setting; read once.
- ``dns``: every A/AAAA record of ``peers_dns`` (NAME:PORT, a headless Service) is a peer listening on
  PORT, resolved with the standard resolver (socket.getaddrinfo, so /etc/hosts counts); its public key
  is the file ``keys_dir/ADDRESS`` (an IPv6 address with ``-`` for ``:`` too, as a ConfigMap key must).
- ``dir``: every ``NAME.toml`` in ``peers_dir`` is a peer: ``endpoint = "tcp://..."`` and
  ``public_key = "..."``, or without ``public_key``, the key in ``keys_dir/NAME``.

A node finds itself in what its source lists (its own public key, or its own port on an address of this
host) and leaves itself out. A listed peer without a key is listed all the same, without one: nothing
connects to it and its connections are refused, and stats shows it.

A mounted ConfigMap or Secret swaps its ``..data`` symlink atomically when it changes; a directory is
read through that link, once resolved, so that one read never mixes two versions. A file that is there
but cannot be read or parsed (a copy half written) keeps what it held before and is reported: remove a
file to take its peer or key away. A refresh that fails as a whole (no answer from DNS, no directory)
keeps the previous listing and is reported; DNS cannot say "no peers", only fail.

Refreshes run on a thread of their own: a lookup may wait seconds for a resolver, which the control
loop must never do. The loop takes each new listing on its tick (Membership.take).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import ValidationError

from ..config import Peer, Settings, tomllib
from .keys import KeyFileError, parse_key

log = logging.getLogger("mmfeatd.mesh")

_PEER_FILE_KEYS = {"endpoint", "public_key"}


@dataclass(frozen=True)
class Listed:
    """A peer as its source lists it: ``name`` is what the source calls it (the endpoint for static,
    the address for dns, the file's name for dir); ``public_key`` is None where it has none."""

    name: str
    endpoint: str
    public_key: Optional[str]


@dataclass(frozen=True)
class Listing:
    peers: tuple[Listed, ...]  # never this node
    addresses: frozenset[str]  # the peers' IP addresses, whose connections a full listener favours
    problems: tuple[str, ...] = ()  # files that could not be used, keys listed twice: logged, in stats


class SourceError(Exception):
    """A refresh that failed as a whole; the previous listing stays."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of tcp://HOST:PORT, an IPv6 host without its brackets."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    return host.strip("[]"), int(port)


def endpoint_of(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def is_local(address: str) -> bool:
    """Whether ``address`` is one of this host's (this network namespace's): only then can a socket bind it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def resolve(host: str) -> set[str]:
    """The IP addresses of ``host`` (an IPv4-mapped IPv6 address as its IPv4 one)."""
    out = set()
    for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
        ip = info[4][0].split("%", 1)[0]
        out.add(ip[len("::ffff:"):] if ip.startswith("::ffff:") else ip)
    return out


def snapshot_dir(directory: Path) -> Path:
    """The directory to read ``directory``'s files from: where its ``..data`` points (a mounted
    ConfigMap or Secret, swapped atomically on change), else itself."""
    data = directory / "..data"
    return Path(os.path.realpath(data)) if data.is_symlink() else directory


def _entries(directory: Path) -> list[Path]:
    # Dot files are the mount's own (..data, ..2024_01_01_...); directories are not peers.
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise SourceError(f"cannot list {directory}: {exc.strerror}") from None
    return [directory / n for n in names if not n.startswith(".") and (directory / n).is_file()]


class _Files:
    """What a directory's files held at the last read; a file there that cannot be used keeps that."""

    def __init__(self, directory: Path, what: str, parse: Callable[[str, str], Any]) -> None:
        self.directory = directory
        self._what = what
        self._parse = parse  # (name, text) -> value, ValueError/KeyFileError when unusable
        self.values: dict[str, Any] = {}

    def read(self, problems: list[str], suffix: str = "") -> dict[str, Any]:
        root = snapshot_dir(self.directory)
        fresh: dict[str, Any] = {}
        for path in _entries(root):
            if not path.name.endswith(suffix):
                continue
            name = path.name[: len(path.name) - len(suffix)] if suffix else path.name
            try:
                fresh[name] = self._parse(name, path.read_text())
            except OSError as exc:
                if isinstance(exc, FileNotFoundError) and root != self.directory:
                    # The mount swapped its ..data while this read: the next refresh reads the new one.
                    raise SourceError(f"{self.directory} changed while it was read") from None
                problems.append(f"{self._what} {path}: {exc.strerror}; what it held before stays")
            except (ValueError, KeyFileError, tomllib.TOMLDecodeError) as exc:
                problems.append(f"{self._what} {path}: {exc}; what it held before stays")
            if name not in fresh and name in self.values:
                fresh[name] = self.values[name]
        self.values = fresh
        return fresh


def _key_file(name: str, text: str) -> str:
    return parse_key(text.strip()).decode()


def _peer_file(name: str, text: str) -> tuple[str, Optional[str]]:
    data = tomllib.loads(text)
    unknown = set(data) - _PEER_FILE_KEYS
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}; a peer file holds endpoint and public_key")
    endpoint = data.get("endpoint")
    key = data.get("public_key")
    if not isinstance(endpoint, str):
        raise ValueError('needs endpoint = "tcp://ADDRESS:PORT"')
    # Peer validates both as the static list's entries are validated; a placeholder key stands in for
    # one that keys_dir gives.
    try:
        Peer(endpoint=endpoint, public_key=key if isinstance(key, str) else "0" * 40)
    except ValidationError as exc:
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
    return endpoint, key


class Membership:
    """The listing of ``settings.peers_from`` as it is now; call start() to refresh it on a thread."""

    def __init__(self, settings: Settings, public_key: str) -> None:
        self.source = settings.peers_from
        self._settings = settings
        self._public_key = public_key
        self._own_port = split_endpoint(settings.listen)[1] if settings.listen else 0
        self._keys = _Files(settings.keys_dir, "key file", _key_file) if settings.keys_dir else None
        self._peer_files = _Files(settings.peers_dir, "peer file", _peer_file) if settings.peers_dir else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.first_read = threading.Event()  # set once the first read is over, whatever came of it
        self._thread: Optional[threading.Thread] = None
        self._fresh: Optional[Listing] = None  # read and not yet taken
        self._last: Optional[Listing] = None  # the thread's, to see what changed
        self._logged: set[str] = set()
        self.refreshes = 0
        self.errors = 0
        self.error: Optional[str] = None  # why the last refresh failed; None once one succeeds
        self.refreshed_at = 0.0

    def start(self) -> None:
        """Static: the listing now. Others: a thread that reads at once, then every peers_refresh_s."""
        if self.source == "static":
            self._publish(self.read())
            self.first_read.set()
            return
        self._thread = threading.Thread(target=self._run, name="mmfeatd-mesh-members", daemon=True)
        self._thread.start()

    def take(self) -> Optional[Listing]:
        """A listing read since the last call that differs from the one before it, if there is one."""
        with self._lock:
            fresh, self._fresh = self._fresh, None
        return fresh

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)  # a lookup it may be in cannot hold up a stop for longer

    def stats(self, now: Optional[float] = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        where = {"static": "peers", "dns": self._settings.peers_dns, "dir": str(self._settings.peers_dir)}
        return {"from": self.source, "name": where[self.source],
                "keys_dir": str(self._settings.keys_dir) if self._settings.keys_dir else None,
                "refreshes": self.refreshes, "errors": self.errors, "error": self.error,
                "refreshed_s_ago": round(now - self.refreshed_at, 3) if self.refreshed_at else None,
                "problems": list(self._last.problems) if self._last else []}

    def _run(self) -> None:
        while True:
            try:
                self._publish(self.read())
            except SourceError as exc:
                self.errors += 1
                self.error = str(exc)
                self._log_once(f"mesh: cannot read the peers (peers_from = {self.source}), keeping the last "
                               f"listing: {exc}")
            except Exception:  # noqa: BLE001 - the thread must outlive one bad refresh
                self.errors += 1
                self.error = "unexpected error (see the log)"
                log.exception("mesh: reading the peers failed")
            self.first_read.set()
            if self._stop.wait(self._settings.peers_refresh_s):
                return

    def _publish(self, listing: Listing) -> None:
        self.refreshes += 1
        self.error = None
        self.refreshed_at = time.monotonic()
        for problem in listing.problems:
            self._log_once("mesh: " + problem)
        if listing != self._last:
            self._last = listing
            with self._lock:
                self._fresh = listing

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            if len(self._logged) > 4096:  # a source that fails differently every time cannot grow this
                self._logged.clear()
            self._logged.add(message)
            log.warning("%s", message)

    def read(self) -> Listing:
        """What the source lists now (SourceError if it cannot be read at all)."""
        problems: list[str] = []
        if self.source == "static":
            listed = [Listed(p.endpoint, p.endpoint, p.public_key) for p in self._settings.peers]
        elif self.source == "dns":
            listed = self._dns(problems)
        else:
            listed = self._dir(problems)
        peers, seen = [], set()
        for entry in listed:
            if entry.public_key is not None and entry.public_key in seen:
                problems.append(f"{entry.name} has the key of a peer listed before it; left out")
                continue
            seen.add(entry.public_key)
            peers.append(entry)
        return Listing(tuple(peers), self._addresses(peers, problems), tuple(problems))

    def _dns(self, problems: list[str]) -> list[Listed]:
        host, port = self._settings.peers_dns.rsplit(":", 1)
        try:
            addresses = sorted(resolve(host))
        except OSError as exc:
            raise SourceError(f"cannot resolve {host}: {getattr(exc, 'strerror', None) or exc}") from None
        assert self._keys is not None  # the settings require keys_dir with dns
        keys = self._keys.read(problems)
        out = []
        for address in addresses:
            key = keys.get(address) or keys.get(address.replace(":", "-"))
            if key == self._public_key or (int(port) == self._own_port and is_local(address)):
                continue  # this node
            if key is None:
                problems.append(f"{address} (from {host}) has no key in {self._keys.directory} (a file named "
                                f"{address}); its connections are refused")
            out.append(Listed(address, endpoint_of(address, int(port)), key))
        return out

    def _dir(self, problems: list[str]) -> list[Listed]:
        assert self._peer_files is not None
        files = self._peer_files.read(problems, ".toml")
        keys = self._keys.read(problems) if self._keys is not None else {}
        out = []
        for name, (endpoint, key) in files.items():
            key = key if key is not None else keys.get(name)
            if key == self._public_key or endpoint == self._settings.listen or self._is_self(endpoint):
                continue
            if key is None:
                problems.append(f"peer file {name}.toml has no public_key and keys_dir no file {name}; its "
                                "connections are refused")
            out.append(Listed(name, endpoint, key))
        return out

    def _is_self(self, endpoint: str) -> bool:
        host, port = split_endpoint(endpoint)
        if port != self._own_port:
            return False
        try:
            return any(is_local(a) for a in resolve(host))
        except OSError:
            return False

    @staticmethod
    def _addresses(peers: list[Listed], problems: list[str]) -> frozenset[str]:
        out: set[str] = set()
        for p in peers:
            host = split_endpoint(p.endpoint)[0]
            try:
                out.update(resolve(host))
            except OSError as exc:
                problems.append(f"cannot resolve peer {p.endpoint} ({exc}); a connection flood may keep it out")
        return frozenset(out)
