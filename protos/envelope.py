"""The envelope of every request and reply (SPEC.md, section 2): the one place that makes and reads
request, ok and error frames, for the client and the daemon alike, so the two ends cannot drift apart.

The daemon checks a request's envelope as strictly as the ops' own fields.

msgpack keeps ints, floats and bools apart, so a client that sends ``4.0`` or ``true`` where an int is
due has a bug; accepting it (Python's ``4.0 == 4``, ``True == 1``) would hide that bug until a daemon
that checks strictly refuses it. A deadline that is NaN would compare false against every clock
reading and so never expire: it is refused with the other numbers that mean nothing as a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from .codec import encode
from .errors import ErrorCode, MmfeatError
from .version import PROTOCOL_VERSION

ENVELOPE_FIELDS = ("v", "op", "id", "quiet", "deadline")
MAX_ID_CHARS = 64

RequestId = Union[int, str]


@dataclass(frozen=True)
class Envelope:
    op: Any  # checked against the op table by the dispatcher, which knows the ops
    id: Optional[RequestId]
    quiet: bool
    deadline: Optional[float]


def is_int(value: Any) -> bool:
    """An int on the wire: msgpack's bool decodes to a Python bool, which is an int to isinstance."""
    return type(value) is int


def reply_id(msg: dict[str, Any]) -> Optional[RequestId]:
    """The id to echo in the reply: the request's own when it is a valid one, else None (the client
    cannot match a reply on an id it did not send as such)."""
    rid = msg.get("id")
    if is_int(rid) or (type(rid) is str and len(rid) <= MAX_ID_CHARS):
        return rid
    return None


def parse_envelope(msg: dict[str, Any]) -> Envelope:
    """The envelope of a decoded request; MmfeatError (UNSUPPORTED_VERSION or BAD_REQUEST) that names
    the field and what it must be."""
    v = msg.get("v")
    # The version first: a client of another version may shape the rest differently.
    if v is not None and not is_int(v):
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"field v must be an int (the protocol version, {PROTOCOL_VERSION}), "
                                                 f"got {type(v).__name__} {v!r}")
    if v != PROTOCOL_VERSION:
        raise MmfeatError(ErrorCode.UNSUPPORTED_VERSION,
                          f"protocol version {v!r} is not {PROTOCOL_VERSION}; upgrade the client or daemon")
    rid = msg.get("id")
    if rid is not None and reply_id(msg) is None:
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"field id must be an int or a str of at most {MAX_ID_CHARS} chars, "
                                                 f"got {_describe(rid)}")
    quiet = msg.get("quiet", False)
    if type(quiet) is not bool:
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"field quiet must be a bool, got {type(quiet).__name__}")
    deadline = msg.get("deadline")
    if deadline is not None:
        if type(deadline) not in (int, float):
            raise MmfeatError(ErrorCode.BAD_REQUEST, f"field deadline must be a number, got {type(deadline).__name__}")
        if not math.isfinite(deadline) or deadline < 0:
            raise MmfeatError(ErrorCode.BAD_REQUEST, f"field deadline must be a finite CLOCK_MONOTONIC time >= 0, "
                                                     f"got {deadline!r}; send none to wait without one")
    return Envelope(op=msg.get("op"), id=rid, quiet=quiet, deadline=deadline)


def split_request(msg: dict[str, Any]) -> tuple[Envelope, dict[str, Any]]:
    """A decoded request's envelope (checked as parse_envelope does) and its op's own fields."""
    return parse_envelope(msg), {k: v for k, v in msg.items() if k not in ENVELOPE_FIELDS}


def request_frame(op: str, req_id: Optional[RequestId], fields: dict[str, Any], quiet: Optional[bool] = None,
                  deadline: Optional[float] = None) -> bytes:
    """One request: the envelope, then the op's fields. ``quiet`` and ``deadline`` are left out when None
    (the daemon's defaults: answered, no deadline)."""
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": op, "id": req_id}
    if quiet is not None:
        msg["quiet"] = quiet
    if deadline is not None:
        msg["deadline"] = deadline
    msg.update(fields)
    return encode(msg)


def ok_frame(req_id: Optional[RequestId], body: dict[str, Any]) -> bytes:
    """A success reply: the op's fields, then the envelope."""
    return encode({**body, "v": PROTOCOL_VERSION, "id": req_id, "ok": True})


def error_frame(req_id: Optional[RequestId], code: ErrorCode, message: str) -> bytes:
    """An error reply; ``message`` says what happened and what to do."""
    return encode({"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "error": {"code": code.value, "message": message}})


def checked_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """A decoded success reply as it came (its op's fields beside the envelope); MmfeatError, the error
    it carries, for an error reply."""
    if reply.get("ok"):
        return reply
    raise MmfeatError.from_reply(reply)


def reply_error(reply: dict[str, Any]) -> tuple[str, str]:
    """An error reply's code and message as text, whatever the peer put there (for logs and counts)."""
    err = reply.get("error")
    err = err if isinstance(err, dict) else {}
    return str(err.get("code")), str(err.get("message"))


def _describe(value: Any) -> str:
    if type(value) is str:
        return f"a str of {len(value)} chars"
    return type(value).__name__
