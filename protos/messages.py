"""Request models, one per op. The daemon validates every request against these before acting.

Validation is strict (no coercion: ``"5"`` is not ``5``) and unknown fields are ignored, so a newer
client may add fields an older daemon does not know (SPEC.md, "Compatibility").
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field

TOKEN_BYTES = 16
MAX_CONSUMERS = 4096
MAX_NBYTES = 1 << 48  # far above any pool; rejects absurd sizes before arithmetic on them

Token = Annotated[bytes, Field(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
Count = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Size = Annotated[int, Field(gt=0, le=MAX_NBYTES)]
Consumers = Annotated[int, Field(ge=1, le=MAX_CONSUMERS)]


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


class PublishRequest(_Message):
    # The producer's session; on the fd channel the connection's own session is used instead.
    session: Token
    lease: LeaseRef


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


class ArenaRequest(_Message):
    session: Token
    device: Optional[Annotated[int, Field(ge=-1, le=1023)]] = None


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
FD_CHANNEL_OPS = frozenset({"publish", "ack", "release", "ping", "arena", "arena_return"})

# op name -> request model. The daemon's handler table (daemon/handlers.py) has the same keys;
# tests/test_spec.py checks that SPEC.md documents each of them.
REQUEST_MODELS: dict[str, type[_Message]] = {
    "hello": HelloRequest,
    "reserve": ReserveRequest,
    "publish": PublishRequest,
    "ack": AckRequest,
    "release": ReleaseRequest,
    "lookup": LookupRequest,
    "remote_get": RemoteGetRequest,
    "arena": ArenaRequest,
    "arena_return": ArenaReturnRequest,
    "fallback": FallbackRequest,
    "ping": EmptyRequest,
    "stats": EmptyRequest,
    "pool_info": EmptyRequest,
}
