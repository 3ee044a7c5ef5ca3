"""Request models, one per op (the reply types, one per op, are in replies.py and named here too). The
daemon validates every request against these before acting.

Validation is strict (no coercion: ``"5"`` is not ``5``) and unknown fields are ignored, so a newer
client may add fields an older daemon does not know (SPEC.md, "Compatibility").
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .keys import key_problem

TOKEN_BYTES = 16
MAX_CONSUMERS = 4096
MAX_NBYTES = 1 << 48  # far above any pool; rejects absurd sizes before arithmetic on them

Token = Annotated[bytes, Field(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
Count = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Size = Annotated[int, Field(gt=0, le=MAX_NBYTES)]
Consumers = Annotated[int, Field(ge=1, le=MAX_CONSUMERS)]
MAX_RETAIN_TTL_S = 7 * 86400.0
# A keyed feature's descriptor as the daemon keeps it for lookups: a pool descriptor of many tensors
# is still far smaller; an fd channel datagram is 4096 bytes.
MAX_KEPT_DESCRIPTOR_BYTES = 2048


def _checked_key(value: str) -> str:
    problem = key_problem(value)
    if problem:
        raise ValueError(problem)
    return value


Key = Annotated[str, AfterValidator(_checked_key)]
RetainTTL = Annotated[float, Field(gt=0, le=MAX_RETAIN_TTL_S, allow_inf_nan=False)]
KeptDescriptor = Annotated[bytes, Field(min_length=1, max_length=MAX_KEPT_DESCRIPTOR_BYTES)]


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class LeaseRef(_Message):
    """Names one lease; every field must match the daemon's record or the request is refused."""

    pool: Count
    epoch: Count
    lease: Count
    gen: Count
    token: Token
    offset: Count
    nbytes: Size


class HelloRequest(_Message):
    name: Annotated[str, Field(max_length=128)] = ""
    pid: Count = 0


class ReserveRequest(_Message):
    session: Token
    nbytes: Size
    consumers: Consumers = 1
    device: Optional[Annotated[int, Field(ge=-1, le=1023)]] = None
    # A keyed feature (SPEC.md, "Keys and lifetimes"): found by key once published; a live key makes
    # the reserve return that feature instead of a new lease.
    key: Optional[Key] = None
    # Retained instead of counted: kept after any number of reads, until this many seconds after its
    # publish pass with no hold on it (or the pool needs the space, or it is evicted by key).
    retain_ttl: Optional[RetainTTL] = None


class PublishRequest(_Message):
    # The producer's session; on the fd channel the connection's own session is used instead.
    session: Token
    lease: LeaseRef
    # The descriptor of a keyed lease, kept for lookups by key (required for one, refused for others).
    descriptor: Optional[KeptDescriptor] = None
    # The producer's GPU stream writes the slot's READY word behind its write: the daemon leaves it.
    stream_ready: bool = False


class BindRequest(_Message):
    """A keyed or retained feature its producer published in its arena: the key and the lifetime the
    daemon binds to it (SPEC.md, section 3, ``bind``), sent once, after the table store that published it."""

    session: Token  # on the fd channel the connection's own session is used instead
    lease: LeaseRef
    key: Optional[Key] = None
    # Retained: published with the CONSUMERS word no count of acks reaches (the lease table's 2**32 - 1).
    retain_ttl: Optional[RetainTTL] = None
    # Required with a key (the feature's pool descriptor, which lookups by key answer), refused without.
    descriptor: Optional[KeptDescriptor] = None


NodeName = Annotated[str, Field(min_length=1, max_length=128)]


class AckRequest(_Message):
    lease: LeaseRef
    # The node whose daemon owns the lease, when it is not this one: the ack is relayed there (mesh).
    node: Optional[NodeName] = None
    count: Consumers = 1
    # Chosen by the consumer per logical ack and reused on a retry, so a retry is applied once.
    ack_id: Optional[Annotated[bytes, Field(min_length=8, max_length=16)]] = None


class ReleaseRequest(_Message):
    session: Token
    lease: LeaseRef


class LookupRequest(_Message):
    lease: LeaseRef


class RemoteGetRequest(_Message):
    """A feature of another node's daemon: this daemon makes it readable here (a pulled copy)."""

    node: NodeName
    lease: LeaseRef
    # How long the client waits; the daemon answers within it, with an error if it must.
    # Strict: an int is taken (it is a number), a bool or a str is not; NaN and inf fail the bounds.
    wait_s: Annotated[float, Field(gt=0, le=600, allow_inf_nan=False)] = 5.0
    # The pool of this daemon's (its numbering) the client would read a pulled copy from: the one on its
    # GPU, on a node with a pool per GPU. A hint: another pool is used if that one cannot take pulls.
    into_pool: Optional[Annotated[int, Field(ge=0, le=1023)]] = None
    # The client could not import the owner's FABRIC handle that this daemon relayed: pull the bytes instead.
    pull: bool = False
    # Answer with a hold over the pulled copy for this many readers, taken by ``session`` (both or neither):
    # a scheduler's, for the ranks it loads for, who read and ack the hold as a feature of this node's.
    session: Optional[Token] = None
    hold: Optional[Consumers] = None


class HoldRequest(_Message):
    """Protect a retained feature for ``count`` readers: a hold of its own, released by their acks."""

    session: Token
    key: Optional[Key] = None
    lease: Optional[LeaseRef] = None  # the feature's own reference instead of its key
    count: Consumers = 1


class LookupKeyRequest(_Message):
    keys: Annotated[list[Key], Field(min_length=1)]
    descriptors: bool = False  # also answer each live key's descriptor (lookup), not only whether it is live


class HoldKeysRequest(_Message):
    """A lookup and a hold in one request: each live retained key held for ``count`` readers."""

    session: Token
    keys: Annotated[list[Key], Field(min_length=1)]
    count: Consumers = 1


class EvictRequest(_Message):
    key: Key


class ArenaRequest(_Message):
    session: Token
    device: Optional[Annotated[int, Field(ge=-1, le=1023)]] = None
    nbytes: Optional[Annotated[int, Field(ge=1, le=(1 << 63) - 1)]] = None  # the feature it must take


class ArenaReturnRequest(_Message):
    session: Token
    arena: Count


class FallbackReason(str, Enum):
    POOL_FULL = "pool_full"
    BELOW_THRESHOLD = "below_threshold"
    UNREACHABLE = "unreachable"
    TOO_LARGE = "too_large"
    DRAINING = "draining"
    OVER_QUOTA = "over_quota"
    MAP_FAILED = "map_failed"
    FD_LIMIT = "fd_limit"


class FallbackRequest(_Message):
    # Strict mode accepts only enum instances; on the wire the reason is its string value.
    reason: Annotated[FallbackReason, Field(strict=False)]
    count: Annotated[int, Field(ge=1, le=1 << 32)] = 1


class EmptyRequest(_Message):
    """For ops that take no fields: ping, stats, pool_info."""


# Ops a client may also send on its fd channel after the handshake (SPEC.md, section 4): there a send
# is a synchronous write into the daemon's socket buffer, so it is read before the channel's EOF.
FD_CHANNEL_OPS = frozenset({"publish", "bind", "ack", "release", "ping", "arena", "arena_return"})

# op name -> request model. The daemon's handler table (daemon/handlers.py) has the same keys;
# tests/test_spec.py checks that SPEC.md documents each of them.
REQUEST_MODELS: dict[str, type[_Message]] = {
    "hello": HelloRequest,
    "reserve": ReserveRequest,
    "publish": PublishRequest,
    "bind": BindRequest,
    "ack": AckRequest,
    "release": ReleaseRequest,
    "lookup": LookupRequest,
    "lookup_key": LookupKeyRequest,
    "hold": HoldRequest,
    "hold_keys": HoldKeysRequest,
    "evict": EvictRequest,
    "remote_get": RemoteGetRequest,
    "arena": ArenaRequest,
    "arena_return": ArenaReturnRequest,
    "fallback": FallbackRequest,
    "ping": EmptyRequest,
    "stats": EmptyRequest,
    "pool_info": EmptyRequest,
}


# The replies, for the many callers that name them from here.
from .replies import (  # noqa: E402, F401
    LeaseRefReply, LeaseReply, AckReply, LookupKeyReply, HoldReply, HoldKeysReply, EvictReply, ReleaseReply, EmptyReply,
    PoolInfo, HelloReply, PoolInfoReply, PingReply, ArenaReply, FabricPool, RemoteGetReply, StatsReply, Reply,
    REPLY_TYPES,
)
