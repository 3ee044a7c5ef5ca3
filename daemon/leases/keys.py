"""Keys: which live feature each key names, the retained features in the order they were published
(the order eviction takes them in), and per-namespace counts for stats.

A key is bound when its lease is published and unbound when the feature ends (or is evicted while
holds keep its bytes): so a key always names a readable feature, and a new daemon (a new epoch)
starts with none. There is at most one key per live lease, so keys are bounded by max_leases.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional

from mmfeat.protos.descriptor import POOL_KINDS, Descriptor, DescriptorError
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.keys import namespace_of

from .lease import Lease

# Namespaces stats keeps entries for; past it, those with no live key go first (lookups of keys in
# namespaces nobody puts to could otherwise grow it without bound).
MAX_NAMESPACES = 1024
# Told of each key bound, with its descriptor, and unbound, with b"" (the key feed, daemon/sockets/key_feed.py).
KeyObserver = Callable[[str, bytes], None]
_FIELDS = ("hits", "misses", "holds", "evictions", "expired", "dedups", "keys", "bytes_retained")


class KeyIndex:
    def __init__(self) -> None:
        self._by_key: dict[str, Lease] = {}
        # slot -> retained PUBLISHED feature, in publish order: a dict keeps insertion order, so the
        # first entries are the oldest (eviction's order).
        self._retained: dict[int, Lease] = {}
        self._ns: dict[str, dict[str, int]] = {}
        # Set by the server while its key feed listens: here rather than in each caller that binds or
        # unbinds, so that no path (publish, bind, evict, expiry, a session's end) can skip it.
        self.feed: Optional[KeyObserver] = None

    def __len__(self) -> int:
        return len(self._by_key)

    def find(self, key: str) -> Optional[Lease]:
        return self._by_key.get(key)

    def bind(self, lease: Lease, key: str, descriptor: bytes) -> None:
        self._by_key[key] = lease
        lease.key, lease.descriptor = key, descriptor
        ns = self._entry(namespace_of(key))
        ns["keys"] += 1
        if lease.retain_ttl is not None:
            ns["bytes_retained"] += lease.size
        if self.feed is not None:
            self.feed(key, descriptor)

    def unbind(self, lease: Lease) -> None:
        """The lease's key finds it no more (it ended, or it was evicted while held)."""
        key = lease.key
        if key is None:
            return
        lease.key = None
        if self._by_key.get(key) is lease:
            del self._by_key[key]
            ns = self._entry(namespace_of(key))
            ns["keys"] -= 1
            if lease.retain_ttl is not None:
                ns["bytes_retained"] -= lease.size
            if self.feed is not None:
                self.feed(key, b"")

    def retained(self, lease: Lease) -> None:
        self._retained[lease.lease_id] = lease

    def not_retained(self, lease: Lease) -> None:
        if self._retained.get(lease.lease_id) is lease:
            del self._retained[lease.lease_id]

    def evictable(self) -> Iterator[Lease]:
        """Retained features nothing holds or pins (as last swept), oldest publish first (a snapshot: the
        caller may free each)."""
        for lease in list(self._retained.values()):
            if not lease.holds and not lease.pins and lease.doomed is None:
                yield lease

    def unheld_retained(self) -> int:
        """Retained features live that nothing holds (a drain does not wait for them)."""
        return sum(1 for lease in self._retained.values() if not lease.holds and not lease.pins)

    def count(self, key: Optional[str], field: str, n: int = 1) -> None:
        if key is not None:
            self._entry(namespace_of(key))[field] += n

    def stats(self) -> dict[str, dict[str, int]]:
        return {ns: dict(entry) for ns, entry in self._ns.items()}

    def _entry(self, ns: str) -> dict[str, int]:
        entry = self._ns.get(ns)
        if entry is None:
            if len(self._ns) >= MAX_NAMESPACES:
                idle = next((n for n, e in self._ns.items() if not e["keys"]), None)
                if idle is not None:
                    del self._ns[idle]
            entry = self._ns[ns] = dict.fromkeys(_FIELDS, 0)
        return entry


def dedups(live: Lease, retain_ttl: Optional[float]) -> bool:
    """Whether a put under the key of ``live`` is answered with ``live`` instead of a lease of its own:
    only when both are retained. A counted feature's consumer count protects its own consumers alone, so
    a second put's consumers would be acked off the first's count (and read it freed)."""
    return live.retain_ttl is not None and retain_ttl is not None


def checked_descriptor(data: Optional[bytes], lease: Lease, epoch: int) -> bytes:
    """``data`` if it is a pool descriptor of exactly this lease (what lookups will answer); BAD_REQUEST
    otherwise, since a consumer would read what it names."""
    if data is None:
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"lease {lease.lease_id} was reserved with a key: publish it with "
                          "its descriptor (field descriptor), which lookups by key answer")
    try:
        desc = Descriptor.from_bytes(data)
    except DescriptorError as exc:
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"publish: the descriptor does not parse: {exc}") from None
    if (desc.kind not in POOL_KINDS or desc.epoch != epoch or desc.pool != lease.pool_id or desc.lease != lease.lease_id
            or desc.gen != lease.gen or desc.token != lease.token or desc.offset != lease.offset
            or desc.nbytes != lease.nbytes):
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"publish: the descriptor does not name lease {lease.lease_id} "
                          "(its pool, epoch, slot, generation, token, offset and size): send the one put made")
    return bytes(data)


def hold_descriptor(base: Lease, hold: Lease) -> Optional[bytes]:
    """The descriptor a hold's readers get and ack: the feature's, naming the hold's slot and token."""
    if base.descriptor is None:
        return None
    desc = Descriptor.from_bytes(base.descriptor)
    return dataclasses.replace(desc, lease=hold.lease_id, gen=hold.gen, token=hold.token).to_bytes()
