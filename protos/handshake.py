"""The fd channel handshake (SPEC.md, section 4) and the arena grant (section 3): their messages are
made and read here, so the daemon and the client cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from .envelope import is_int
from .errors import ErrorCode, MmfeatError
from .version import PROTOCOL_VERSION

# The largest handshake datagram either side sends (and so reads).
MAX_HANDSHAKE_BYTES = 4096


def hello(session: bytes, pools: bool = True) -> bytes:
    """The client's first datagram: its session token from the control socket's hello. ``pools`` False:
    a control-only client, which maps no pool and is sent the lease table's fd alone."""
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "session": session}
    if not pools:
        msg["pools"] = False
    return msgpack.packb(msg, use_bin_type=True)


def wants_pools(data: bytes) -> bool:
    """Whether a client's first datagram (parse_hello accepted it) asks for the pools' fds: all but a
    control-only client's, which says ``pools: false``."""
    msg = msgpack.unpackb(data, raw=False, max_ext_len=0)
    return msg.get("pools") is not False


def parse_hello(data: bytes) -> bytes:
    """The session token in a client's first datagram; MmfeatError for anything else."""
    try:
        msg = msgpack.unpackb(data, raw=False, max_ext_len=0)
    except Exception:
        raise MmfeatError(ErrorCode.BAD_REQUEST, "fd channel hello is not msgpack") from None
    if not isinstance(msg, dict) or not is_int(msg.get("v")) or msg["v"] != PROTOCOL_VERSION:
        # 4.0 and true are not 4 here either (SPEC.md, section 2: types are checked strictly).
        raise MmfeatError(ErrorCode.UNSUPPORTED_VERSION, f"fd channel speaks version {PROTOCOL_VERSION} (an int)")
    token = msg.get("session")
    if not isinstance(token, bytes):
        raise MmfeatError(ErrorCode.BAD_REQUEST, "fd channel hello needs 'session' (bytes from the hello reply)")
    return token


def accepted(pool_ids: list[int]) -> bytes:
    """The daemon's answer that goes with one fd per pool in ``pool_ids``, then the lease table's."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "ok": True, "pools": pool_ids, "table": True}, use_bin_type=True)


def refused(error: MmfeatError) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "ok": False, "error": error.to_wire()}, use_bin_type=True)


def parse_answer(data: bytes, fds_received: int) -> list[int]:
    """The pool ids of the daemon's answer, in the order of the fds that came with it (the lease
    table's fd follows them); MmfeatError for a refusal or an answer that does not match its fds."""
    reply = msgpack.unpackb(data, raw=False)
    if not isinstance(reply, dict):
        raise MmfeatError(ErrorCode.INTERNAL, "the daemon's fd channel answer is not a map")
    if not reply.get("ok"):
        raise MmfeatError.from_reply(reply)
    pools = reply.get("pools", [])
    if not reply.get("table") or not isinstance(pools, list) or len(pools) + 1 != fds_received:
        raise MmfeatError(ErrorCode.INTERNAL,
                          f"daemon named {len(pools)} pools and a table but sent {fds_received} fds")
    return pools


@dataclass(frozen=True)
class ArenaGrant:
    """The ``arena`` reply: ``[offset, offset + size)`` of ``pool``, and lease slots ``slot_base`` to
    ``slot_base + slots - 1``."""

    id: int
    pool: int
    offset: int
    size: int
    slot_base: int
    slots: int

    def to_wire(self) -> dict[str, int]:
        return {"id": self.id, "pool": self.pool, "offset": self.offset, "size": self.size,
                "slot_base": self.slot_base, "slots": self.slots}

    @classmethod
    def from_wire(cls, fields: Any) -> "ArenaGrant":
        names = cls.__dataclass_fields__
        if not isinstance(fields, dict) or not all(isinstance(fields.get(k), int) and fields[k] >= 0 for k in names):
            raise MmfeatError(ErrorCode.INTERNAL, f"the daemon's arena grant is malformed: {fields!r}")
        return cls(**{k: fields[k] for k in names})
