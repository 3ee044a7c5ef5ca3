"""Turn one request frame into one reply frame. Never raises: every failure becomes a typed error reply."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from pydantic import ValidationError

from mmfeat.protos.codec import DecodeError, decode
from mmfeat.protos.envelope import error_frame, ok_frame, reply_id, split_request
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.messages import FD_CHANNEL_OPS, REQUEST_MODELS

from .core import DaemonCore
from .handlers import HANDLERS, Deferred

log = logging.getLogger("mmfeatd.dispatch")


SendLater = Callable[[bytes], None]


def dispatch(core: DaemonCore, frame: bytes, now: Optional[float] = None, session: Optional[bytes] = None,
             send_later: Optional[SendLater] = None) -> Optional[bytes]:
    """The reply to ``frame``; None for a quiet request that succeeded (it is answered only if it fails),
    and for one whose answer comes later, through ``send_later`` (it waits on another node).

    ``session`` is set for a frame that came on a session's fd channel: only FD_CHANNEL_OPS are taken
    there, and the connection's session stands in for any the frame names.
    """
    now = time.monotonic() if now is None else now
    core.counters.requests += 1
    try:
        msg = decode(frame)
    except DecodeError as exc:
        core.counters.bad_requests += 1
        code = ErrorCode.TOO_LARGE if exc.too_large else ErrorCode.BAD_REQUEST
        return error_frame(None, code, str(exc))
    req_id = reply_id(msg)
    try:
        env, fields = split_request(msg)
    except MmfeatError as exc:
        core.counters.bad_requests += 1
        return error_frame(req_id, exc.code, exc.message)
    quiet, deadline = env.quiet, env.deadline
    if deadline is not None and now > deadline:
        # The client stopped waiting (the daemon was frozen or swamped): acting now would apply a
        # request it believes failed, such as an ack it will retry or a reserve it fell back from.
        core.counters.late_requests += 1
        return error_frame(req_id, ErrorCode.TIMED_OUT,
                           f"reached the daemon {now - deadline:.3f} s after its deadline; not applied")
    op = env.op
    model = REQUEST_MODELS.get(op) if isinstance(op, str) else None
    if session is not None and model is not None and op not in FD_CHANNEL_OPS:
        core.counters.bad_requests += 1
        return error_frame(req_id, ErrorCode.UNKNOWN_OP,
                           f"op {op!r} is not taken on the fd channel; only {', '.join(sorted(FD_CHANNEL_OPS))}")
    if model is None:
        core.counters.bad_requests += 1
        return error_frame(req_id, ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; known: {', '.join(HANDLERS)}")
    by_op = core.counters.requests_by_op
    by_op[op] = by_op.get(op, 0) + 1
    try:
        if session is not None and "session" in model.model_fields:
            fields["session"] = session
        req = model.model_validate(fields)
    except ValidationError as exc:
        core.counters.bad_requests += 1
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "request"
        return error_frame(req_id, ErrorCode.BAD_REQUEST,
                           f"{op}: field {where}: {first['msg']} ({exc.error_count()} error(s))")
    try:
        body = HANDLERS[op](core, req, now)
        if isinstance(body, Deferred):
            if quiet:
                body.start(None)
                return None
            if send_later is None:
                raise MmfeatError(ErrorCode.BAD_REQUEST,
                                  f"{op} waits for another node's daemon; send it on the control socket")
            body.start(lambda result: send_later(_result_reply(req_id, result)))
            return None
    except MmfeatError as exc:
        return error_frame(req_id, exc.code, exc.message)
    except Exception:
        log.exception("handler for %s failed", op)
        return error_frame(req_id, ErrorCode.INTERNAL, f"{op} failed inside the daemon; see its log")
    if quiet:
        return None
    return ok_frame(req_id, body.to_wire())


def _result_reply(req_id: Any, result: Any) -> bytes:
    """The reply to a deferred request: its body, or the error it ended with."""
    if isinstance(result, MmfeatError):
        return error_frame(req_id, result.code, result.message)
    return ok_frame(req_id, result.to_wire())
