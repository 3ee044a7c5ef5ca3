"""Reply types, one per op's reply body: what the daemon sends (``to_wire``) and the client reads
(``from_wire``), each field's wire type checked at the read. The requests are in messages.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, TypeVar, Union

from .errors import ErrorCode, MmfeatError
from .handshake import ArenaGrant


# --- Replies ------------------------------------------------------------------------------------------
#
# One type per op's reply body (the envelope is protos/envelope.py's). The daemon makes them from its own
# state and sends ``to_wire()``: no validation there, since reserve and ack replies are on every put's and
# ack's path (and not frozen: a frozen dataclass's __init__ goes through object.__setattr__ per field).
# The client reads them with ``from_wire``, which checks each field's wire type, so a reply that is not
# what SPEC.md says is a typed error at the read, not a KeyError or a bad offset later. The replies read
# on every reserve and ack are read by hand; where their fast check fails the generic read says why.

_WireTypes = Union[type, tuple[type, ...]]


def _reply_error(cls: type, problem: str) -> MmfeatError:
    return MmfeatError(ErrorCode.INTERNAL, f"the daemon's {cls.__name__} {problem}; are the client and mmfeatd "
                                           f"of the same release?")


def _read(cls: Any, body: Any) -> dict[str, Any]:
    """``cls``'s fields from a decoded reply body, each checked against ``cls._WIRE``."""
    if not isinstance(body, dict):
        raise _reply_error(cls, f"is a {type(body).__name__}, not a map")
    out: dict[str, Any] = {}
    for name, wire in cls._WIRE.items():
        if name not in body:
            if name in cls._OPTIONAL:
                continue
            raise _reply_error(cls, f"lacks field {name}")
        value = body[name]
        nested = cls._NESTED.get(name)
        items = cls._ITEMS.get(name)
        if nested is not None and value is not None:
            value = nested.from_wire(value)
        elif items is not None and type(value) is list:
            value = tuple(items.from_wire(v) for v in value)
        elif not (type(value) in wire if isinstance(wire, tuple) else type(value) is wire):
            raise _reply_error(cls, f"has {name} = {type(value).__name__}, not {_names(wire)}")
        out[name] = value
    return out


def _names(wire: _WireTypes) -> str:
    return " or ".join(t.__name__ for t in (wire if isinstance(wire, tuple) else (wire,)))


class _Reply:
    # field -> the wire types it may have (msgpack keeps int, float, bool, str, bin, nil apart); fields in
    # _NESTED are reply types of their own, those in _ITEMS lists of one; fields in _OPTIONAL may be
    # absent (their default stands).
    _WIRE: ClassVar[dict[str, _WireTypes]] = {}
    _NESTED: ClassVar[dict[str, Any]] = {}
    _ITEMS: ClassVar[dict[str, Any]] = {}
    _OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_wire(cls: type[_R], body: Any) -> _R:
        return cls(**_read(cls, body))

    def to_wire(self) -> dict[str, Any]:
        return {name: _wire(getattr(self, name)) for name in self._WIRE}


_R = TypeVar("_R", bound=_Reply)


def _wire(value: Any) -> Any:
    if isinstance(value, _Reply):
        return value.to_wire()
    if isinstance(value, tuple):
        return [_wire(v) for v in value]
    return value


_NUM = (int, float)
_OPT_BYTES = (bytes, type(None))
_OPT_STR = (str, type(None))
_OPT_BOOL = (bool, type(None))


@dataclass(slots=True)
class LeaseRefReply(_Reply):
    """A lease reference as the daemon hands it out (LeaseRef is the same map as a request sends it)."""

    pool: int
    epoch: int
    lease: int
    gen: int
    token: bytes
    offset: int
    nbytes: int
    _WIRE = {"pool": int, "epoch": int, "lease": int, "gen": int, "token": bytes, "offset": int, "nbytes": int}

    @classmethod
    def from_wire(cls, body: Any) -> "LeaseRefReply":
        try:
            pool, epoch, lease, gen = body["pool"], body["epoch"], body["lease"], body["gen"]
            token, offset, nbytes = body["token"], body["offset"], body["nbytes"]
        except (KeyError, TypeError, IndexError):
            return cls(**_read(cls, body))
        if (type(pool) is int and type(epoch) is int and type(lease) is int and type(gen) is int
                and type(token) is bytes and type(offset) is int and type(nbytes) is int):
            return cls(pool, epoch, lease, gen, token, offset, nbytes)
        return cls(**_read(cls, body))

    def to_wire(self) -> dict[str, Any]:  # by hand: in every reserve, publish and lookup reply
        return {"pool": self.pool, "epoch": self.epoch, "lease": self.lease, "gen": self.gen, "token": self.token,
                "offset": self.offset, "nbytes": self.nbytes}


@dataclass(slots=True)
class LeaseReply(_Reply):
    """reserve, publish and lookup. ``expires_in``: seconds from the reply until the lease's own deadline
    (a RESERVED lease's reserve_ttl, a PUBLISHED one's ack_ttl, as they were when it entered that
    state); absent from a daemon that predates it."""

    lease: LeaseRefReply
    state: str
    consumers: int
    remaining: int
    expires_in: Optional[float] = None
    # A keyed feature's descriptor, as lookups by key answer it: in a reserve reply only when the key was
    # live (nothing was reserved: ``lease`` is that feature's), in a publish reply of a keyed lease.
    descriptor: Optional[bytes] = None
    _WIRE = {"lease": dict, "state": str, "consumers": int, "remaining": int, "expires_in": _NUM, "descriptor": bytes}
    _NESTED = {"lease": LeaseRefReply}
    _OPTIONAL = frozenset({"expires_in", "descriptor"})

    @classmethod
    def from_wire(cls, body: Any) -> "LeaseReply":
        try:
            lease, state, consumers, remaining = body["lease"], body["state"], body["consumers"], body["remaining"]
            expires_in = body.get("expires_in")
            descriptor = body.get("descriptor")
        except (KeyError, TypeError, IndexError, AttributeError):
            return cls(**_read(cls, body))
        if (type(state) is str and type(consumers) is int and type(remaining) is int
                and (expires_in is None or type(expires_in) is float) and type(descriptor) in _OPT_BYTES):
            return cls(LeaseRefReply.from_wire(lease), state, consumers, remaining, expires_in, descriptor)
        return cls(**_read(cls, body))

    def to_wire(self) -> dict[str, Any]:  # by hand: on every reserve's path
        body: dict[str, Any] = {"lease": self.lease.to_wire(), "state": self.state, "consumers": self.consumers,
                                "remaining": self.remaining}
        if self.expires_in is not None:
            body["expires_in"] = self.expires_in
        if self.descriptor is not None:
            body["descriptor"] = self.descriptor
        return body


@dataclass(slots=True)
class AckReply(_Reply):
    remaining: int
    freed: bool
    over_acked: int
    # Whether this ack_id was applied before; None for an ack relayed to another node (not sent then).
    duplicate: Optional[bool] = None
    _WIRE = {"remaining": int, "freed": bool, "over_acked": int, "duplicate": bool}
    _OPTIONAL = frozenset({"duplicate"})

    @classmethod
    def from_wire(cls, body: Any) -> "AckReply":
        try:
            remaining, freed, over_acked = body["remaining"], body["freed"], body["over_acked"]
            duplicate = body.get("duplicate")
        except (KeyError, TypeError, IndexError, AttributeError):
            return cls(**_read(cls, body))
        if type(remaining) is int and type(freed) is bool and type(over_acked) is int and type(duplicate) in _OPT_BOOL:
            return cls(remaining, freed, over_acked, duplicate)
        return cls(**_read(cls, body))

    def to_wire(self) -> dict[str, Any]:  # by hand: on every waiting ack's path
        body: dict[str, Any] = {"remaining": self.remaining, "freed": self.freed, "over_acked": self.over_acked}
        if self.duplicate is not None:
            body["duplicate"] = self.duplicate
        return body


@dataclass(slots=True)
class LookupKeyReply(_Reply):
    """Per key asked, in order: whether a feature is live under it, and (when asked) its descriptor or nil."""

    found: tuple[bool, ...]
    descriptors: Optional[tuple[Optional[bytes], ...]] = None
    _WIRE = {"found": list, "descriptors": list}
    _OPTIONAL = frozenset({"descriptors"})

    @classmethod
    def from_wire(cls, body: Any) -> "LookupKeyReply":
        out = _read(cls, body)
        found = tuple(out["found"])
        if not all(type(f) is bool for f in found):
            raise _reply_error(cls, "has found items that are not bools")
        descs = out.get("descriptors")
        if descs is not None:
            descs = tuple(descs)
            if len(descs) != len(found) or not all(type(d) in _OPT_BYTES for d in descs):
                raise _reply_error(cls, "has descriptors that are not one bin or nil per key")
        return cls(found, descs)

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"found": list(self.found)}
        if self.descriptors is not None:
            body["descriptors"] = list(self.descriptors)
        return body


@dataclass(slots=True)
class HoldReply(_Reply):
    """The hold: a lease of its own over the feature's bytes, and the descriptor its readers get and ack."""

    lease: LeaseRefReply
    descriptor: Optional[bytes]  # nil for a feature held by its lease that has no key (the holder has its descriptor)
    _WIRE = {"lease": dict, "descriptor": _OPT_BYTES}
    _NESTED = {"lease": LeaseRefReply}


@dataclass(slots=True)
class HoldKeysReply(_Reply):
    """Per key asked, in order: the descriptor its readers get and ack, or nil for no live feature; and
    whether it is a hold's (a retained feature's) rather than a counted feature's own."""

    descriptors: tuple[Optional[bytes], ...]
    held: tuple[bool, ...]
    _WIRE = {"descriptors": list, "held": list}

    @classmethod
    def from_wire(cls, body: Any) -> "HoldKeysReply":
        out = _read(cls, body)
        descs, held = tuple(out["descriptors"]), tuple(out["held"])
        if (len(descs) != len(held) or not all(type(d) in _OPT_BYTES for d in descs)
                or not all(type(h) is bool and (not h or d is not None) for d, h in zip(descs, held))):
            raise _reply_error(cls, "has descriptors and held flags that are not one bin or nil and one bool per key")
        return cls(descs, held)

    def to_wire(self) -> dict[str, Any]:
        return {"descriptors": list(self.descriptors), "held": list(self.held)}


@dataclass(slots=True)
class EvictReply(_Reply):
    evicted: bool  # a feature was live under the key; it is not findable by it any more
    held: bool  # holds still protect it: its bytes go once the last of them ends
    _WIRE = {"evicted": bool, "held": bool}


@dataclass(slots=True)
class ReleaseReply(_Reply):
    freed: bool
    _WIRE = {"freed": bool}


@dataclass(slots=True)
class EmptyReply(_Reply):
    """arena_return and fallback."""


@dataclass(slots=True)
class PoolInfo(_Reply):
    pool: int
    epoch: int
    kind: str
    device: int
    size: int
    handle: str
    fabric: Optional[bytes]
    uuid: Optional[str]
    _WIRE = {"pool": int, "epoch": int, "kind": str, "device": int, "size": int, "handle": str,
             "fabric": _OPT_BYTES, "uuid": _OPT_STR}


@dataclass(slots=True)
class HelloReply(_Reply):
    session: bytes
    epoch: int
    node: str
    endpoint: str
    pools: tuple[PoolInfo, ...]
    reserve_ttl: float
    ack_ttl: float
    max_request_bytes: int
    table_slots: int
    arenas: bool
    gpu_publish: str
    clock: float
    # The daemon takes ``bind``: keyed and retained features published in arenas. False from a daemon
    # that predates it, whose producers reserve such features.
    bind: bool = False
    ready_ttl: Optional[float] = None  # absent from a daemon of an earlier release: its ack_ttl bounds the waits
    # The daemon honours pins of retained features in the lease table; False from an earlier release,
    # which would free a pinned feature: clients hold by message there.
    pins: bool = False
    # The key feed's endpoint (SPEC.md, section 12); empty where the daemon has none, absent from one that
    # predates it.
    feed: str = ""
    _WIRE = {"session": bytes, "epoch": int, "node": str, "endpoint": str, "pools": list, "reserve_ttl": _NUM,
             "ack_ttl": _NUM, "max_request_bytes": int, "table_slots": int, "arenas": bool, "gpu_publish": str,
             "clock": _NUM, "bind": bool, "ready_ttl": _NUM, "pins": bool, "feed": str}
    _ITEMS = {"pools": PoolInfo}
    _OPTIONAL = frozenset({"bind", "ready_ttl", "pins", "feed"})


@dataclass(slots=True)
class PoolInfoReply(_Reply):
    epoch: int
    pools: tuple[PoolInfo, ...]
    _WIRE = {"epoch": int, "pools": list}
    _ITEMS = {"pools": PoolInfo}


@dataclass(slots=True)
class PingReply(_Reply):
    epoch: int
    node: str
    draining: bool
    _WIRE = {"epoch": int, "node": str, "draining": bool}


@dataclass(slots=True)
class ArenaReply(_Reply):
    arena: ArenaGrant  # also the layout the lease table's arenas follow (SPEC.md, section 5)
    _WIRE = {"arena": dict}
    _NESTED = {"arena": ArenaGrant}

    def to_wire(self) -> dict[str, Any]:
        return {"arena": self.arena.to_wire()}


@dataclass(slots=True)
class FabricPool(_Reply):
    """Another node's FABRIC pool, to import and map as a pool of hello's (remote_get)."""

    node: str
    epoch: int
    pool: int
    size: int
    device: int
    handle: str
    fabric: bytes
    _WIRE = {"node": str, "epoch": int, "pool": int, "size": int, "device": int, "handle": str, "fabric": bytes}


@dataclass(slots=True)
class RemoteGetReply(_Reply):
    """A pulled copy: ``lease`` is this daemon's. The FABRIC route: ``fabric`` set, ``lease`` the owner's."""

    lease: LeaseRefReply
    fabric: Optional[FabricPool] = None
    _WIRE = {"fabric": dict, "lease": dict}
    _NESTED = {"fabric": FabricPool, "lease": LeaseRefReply}
    _OPTIONAL = frozenset({"fabric"})

    def to_wire(self) -> dict[str, Any]:
        if self.fabric is None:
            return {"lease": self.lease.to_wire()}
        return {"fabric": self.fabric.to_wire(), "lease": self.lease.to_wire()}


@dataclass(slots=True)
class StatsReply(_Reply):
    """What operators read; its nested maps are SPEC.md's ``stats`` section."""

    node: str
    pid: int
    epoch: int
    uptime_s: float
    draining: bool
    gpu_publish: str
    unwritten: int
    clients: int
    sessions: int
    leases: dict
    timers: int
    swept_slots: int
    pools: list
    counters: dict
    limits: dict
    mesh: Optional[dict]
    # Keyed features by namespace (SPEC.md, "Keys and lifetimes"), and the holds live now.
    namespaces: Optional[dict] = None
    holds: Optional[int] = None
    # Reservations past their reserve_ttl whose ranges are kept for their live producers (SPEC.md, reserve).
    expired_reserved: Optional[int] = None
    pins: Optional[int] = None  # reads pinned in the lease table and not yet released, as last swept
    _WIRE = {"node": str, "pid": int, "epoch": int, "uptime_s": _NUM, "draining": bool, "gpu_publish": str,
             "unwritten": int, "clients": int,
             "sessions": int, "leases": dict, "timers": int, "swept_slots": int, "pools": list, "counters": dict,
             "limits": dict, "mesh": (dict, type(None)), "namespaces": dict, "holds": int, "expired_reserved": int,
             "pins": int}
    _OPTIONAL = frozenset({"namespaces", "holds", "expired_reserved", "pins"})


Reply = _Reply  # any op's reply type

# op name -> reply type; tests/test_spec.py checks that SPEC.md documents each field.
REPLY_TYPES: dict[str, type[_Reply]] = {
    "hello": HelloReply,
    "reserve": LeaseReply,
    "publish": LeaseReply,
    "bind": LeaseReply,
    "ack": AckReply,
    "release": ReleaseReply,
    "lookup": LeaseReply,
    "lookup_key": LookupKeyReply,
    "hold": HoldReply,
    "hold_keys": HoldKeysReply,
    "evict": EvictReply,
    "remote_get": RemoteGetReply,
    "arena": ArenaReply,
    "arena_return": EmptyReply,
    "fallback": EmptyReply,
    "ping": PingReply,
    "stats": StatsReply,
    "pool_info": PoolInfoReply,
}
