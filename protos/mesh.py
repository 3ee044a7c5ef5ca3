"""Messages between daemons of different nodes (the mesh), over ZeroMQ CURVE on tcp://.

Only daemons speak this; a client never does. Each daemon binds a ROUTER on ``listen`` and connects a
DEALER to every listed peer; CURVE with the peers' listed public keys authenticates and encrypts both
directions. A frame is one msgpack map ``{"v": MESH_VERSION, "op": ..., ...}``. SPEC.md, "The mesh",
is the written contract; ``MESH_OPS`` is the table both it and the daemon follow.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MESH_VERSION = 3
# A hello carries a few pools, their handle bytes and NIXL metadata; an ack batch at most MAX_MESH_BATCH
# entries of about 100 B. Nothing legitimate comes near this.
MAX_MESH_FRAME = 64 << 10
MAX_MESH_POOLS = 64
MAX_MESH_BATCH = 256
MAX_NIXL_METADATA = 16 << 10
FABRIC_HANDLE_BYTES = 64
TOKEN_BYTES = 16

Count = Annotated[int, Field(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, Field(min_length=1, max_length=128)]


class MeshError(ValueError):
    """A mesh frame that is not a valid message; the message says what is wrong."""


class _Mesh(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class MeshPool(_Mesh):
    pool: Count
    kind: Annotated[str, Field(pattern="^(host|cuda)$")]
    device: Annotated[int, Field(ge=-1, le=1023)]
    handle: Annotated[str, Field(pattern="^(posix_fd|fabric)$")]
    size: Count
    # The FABRIC handle's bytes (cuMemExportToShareableHandle), for importers in the same NVLink domain.
    fabric: Optional[Annotated[bytes, Field(min_length=FABRIC_HANDLE_BYTES, max_length=FABRIC_HANDLE_BYTES)]] = None
    # Where the pool starts in the sender's NIXL registration (its own address space); 0: not registered,
    # so it cannot be pulled from.
    addr: Count = 0


class MeshTable(_Mesh):
    """Where the sender's lease table (SPEC.md section 5) is registered with its NIXL agent: a puller
    READs a feature's STATE word and entry after its bytes, to know they were the feature's."""

    addr: Annotated[int, Field(gt=0, le=(1 << 64) - 1)]
    slots: Annotated[int, Field(gt=0, le=1 << 24)]


class MeshFabricDomain(_Mesh):
    """The sender's multi-node NVLink domain (NVML's cluster UUID and clique id of its FABRIC pools'
    GPUs): a FABRIC handle is only importable between nodes that announce the same one."""

    cluster_uuid: Annotated[str, Field(pattern="^[0-9a-f]{32}$")]
    clique: Annotated[int, Field(ge=0, le=(1 << 32) - 1)]


class MeshHello(_Mesh):
    """Who a daemon is: sent on connecting and again whenever its epoch changes."""

    node: Name
    epoch: Count
    pools: Annotated[list[MeshPool], Field(max_length=MAX_MESH_POOLS)]
    # The sender's NIXL agent metadata (opaque to mmfeat), None when it has no NIXL: with it a peer can
    # READ the registered pools. It travels only here, over CURVE, to listed peers.
    nixl: Optional[Annotated[bytes, Field(min_length=1, max_length=MAX_NIXL_METADATA)]] = None
    table: Optional[MeshTable] = None  # with nixl: the lease table, registered too
    fabric_domain: Optional[MeshFabricDomain] = None  # None: no FABRIC pool, or its domain is unknown


class MeshLease(_Mesh):
    """A lease of the receiving daemon, as a descriptor names it (every field must match its record)."""

    pool: Count
    epoch: Count
    lease: Count
    gen: Count
    token: Annotated[bytes, Field(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
    offset: Count
    nbytes: Annotated[int, Field(gt=0, le=1 << 48)]


class MeshCheck(_Mesh):
    """After a pull: is this lease still live and published? (Then the bytes read were its bytes.)"""

    req: Count
    lease: MeshLease


class MeshChecked(_Mesh):
    req: Count
    code: Annotated[str, Field(max_length=32)] = ""  # empty: live; else the ErrorCode that says why not
    message: Annotated[str, Field(max_length=512)] = ""


class MeshAck(_Mesh):
    lease: MeshLease
    count: Annotated[int, Field(ge=1, le=4096)] = 1
    ack_id: Optional[Annotated[bytes, Field(min_length=8, max_length=16)]] = None


class MeshAcks(_Mesh):
    """Consumers on the sender's node are done with these features of the receiver's."""

    batch: Count
    acks: Annotated[list[MeshAck], Field(min_length=1, max_length=MAX_MESH_BATCH)]


class MeshAckResult(_Mesh):
    remaining: Count = 0
    freed: bool = False
    over_acked: Count = 0
    code: Annotated[str, Field(max_length=32)] = ""
    message: Annotated[str, Field(max_length=512)] = ""


class MeshAcked(_Mesh):
    batch: Count
    results: Annotated[list[MeshAckResult], Field(max_length=MAX_MESH_BATCH)]


class MeshPulled(_Mesh):
    """The sender pulled these features of the receiver's (and checked them in its lease table): the
    receiver sends ``ended`` for each when it ends, so the sender can drop its copy."""

    leases: Annotated[list[MeshLease], Field(min_length=1, max_length=MAX_MESH_BATCH)]


class MeshEnded(_Mesh):
    """Features of the sender's that the receiver pulled have ended: its copies may go."""

    epoch: Count
    leases: Annotated[list[Annotated[list[Count], Field(min_length=2, max_length=2)]],
                      Field(min_length=1, max_length=MAX_MESH_BATCH)]  # [lease, gen]


class MeshPing(_Mesh):
    """A heartbeat; the peer answers with a pong carrying the same ``seq``."""

    seq: Count


class MeshPong(_Mesh):
    seq: Count
    need_hello: bool = False  # the listener has no hello from this peer (it restarted, or missed it)


MESH_OPS: dict[str, type[_Mesh]] = {
    "hello": MeshHello, "ping": MeshPing, "pong": MeshPong,
    "check": MeshCheck, "checked": MeshChecked,
    "acks": MeshAcks, "acked": MeshAcked,
    "pulled": MeshPulled,
    "ended": MeshEnded,
}
# Which way each op travels: requests from a daemon's DEALER to the peer's ROUTER, replies back.
MESH_REQUESTS = frozenset({"hello", "ping", "check", "acks", "pulled", "ended"})
MESH_REPLIES = frozenset({"pong", "checked", "acked"})


def encode_mesh(op: str, body: dict[str, Any]) -> bytes:
    if op not in MESH_OPS:
        raise ValueError(f"unknown mesh op {op!r}")
    return msgpack.packb({"v": MESH_VERSION, "op": op, **body}, use_bin_type=True)


def decode_mesh(frame: bytes) -> tuple[str, _Mesh]:
    """The op and its validated body; MeshError for anything else, whatever the bytes."""
    if len(frame) > MAX_MESH_FRAME:
        raise MeshError(f"mesh frame of {len(frame)} B exceeds {MAX_MESH_FRAME} B")
    try:
        raw = msgpack.unpackb(frame, raw=False, max_bin_len=MAX_MESH_FRAME, max_str_len=MAX_MESH_FRAME,
                              max_array_len=MAX_MESH_BATCH, max_map_len=32, max_ext_len=0)
    except Exception as exc:
        raise MeshError(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(raw, dict):
        raise MeshError("a mesh frame is a msgpack map")
    if raw.get("v") != MESH_VERSION:
        raise MeshError(f"mesh version {raw.get('v')!r} is not {MESH_VERSION}; run the same mmfeat on every node")
    op = raw.get("op")
    model = MESH_OPS.get(op) if isinstance(op, str) else None
    if model is None:
        raise MeshError(f"unknown mesh op {op!r}")
    try:
        return op, model.model_validate(raw)
    except ValidationError as exc:
        raise MeshError(f"bad {op}: {exc.errors()[0].get('msg', 'invalid')} at {exc.errors()[0].get('loc')}") from None
