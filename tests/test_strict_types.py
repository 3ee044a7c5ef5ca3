"""Strict types on the wire: every envelope key and every numeric field of every request refuses what
only looks like its type (4.0 for 4, true for 1, "1", NaN, inf, out of range) with a typed error reply,
and the daemon keeps serving."""

from __future__ import annotations

import math
import socket
import typing
from typing import Any, Iterator

import msgpack
import pytest
from pydantic import BaseModel

from mmfeat.protos import PROTOCOL_VERSION, REQUEST_MODELS, ErrorCode

from .conftest import Daemon, daemon_for_bad_input
from .test_bad_input import _raw_to

NAN, INF = math.nan, math.inf
S = b"s" * 16
LEASE = {"pool": 0, "epoch": 1, "lease": 0, "gen": 0, "token": b"t" * 16, "offset": 0, "nbytes": 256}
# One well-formed request per op: it may fail (no such session or lease), but never as BAD_REQUEST, so
# a BAD_REQUEST below is the bad value's doing.
BASE: dict[str, dict[str, Any]] = {
    "hello": {"name": "strict"},
    "reserve": {"session": S, "nbytes": 256},
    "publish": {"session": S, "lease": LEASE},
    "ack": {"lease": LEASE},
    "release": {"session": S, "lease": LEASE},
    "lookup": {"lease": LEASE},
    "lookup_key": {"keys": ["0123456789abcdef/k"]},
    "hold": {"session": S, "lease": LEASE},
    "evict": {"key": "0123456789abcdef/k"},
    "bind": {"session": S, "lease": LEASE, "retain_ttl": 60.0},
    "hold_keys": {"session": S, "keys": ["0123456789abcdef/k"], "count": 1},
    "remote_get": {"node": "elsewhere", "lease": LEASE, "wait_s": 0.5},
    "arena": {"session": S},
    "arena_return": {"session": S, "arena": 0},
    "fallback": {"reason": "pool_full"},
    "ping": {},
    "stats": {},
    "pool_info": {},
}
# Below every field's lower bound, above none's upper one: a wrong value of the right type.
NOT_INTS = [1.0, 0.0, True, False, NAN, INF, -INF, "1", b"\x01", [1], -(1 << 63)]
NOT_FLOATS = [True, False, NAN, INF, -INF, -1.0, 0.0, "1", b"1", [1.0]]


@pytest.fixture(scope="module")
def strict_daemon() -> Iterator[Daemon]:
    yield from daemon_for_bad_input("the ill-typed requests")


@pytest.fixture
def send(strict_daemon):
    yield from _raw_to(strict_daemon)


def _frame(**fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": 7, **fields}, use_bin_type=True)


def _numeric_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type]]:
    """(path, int or float) of every number in a request model, nested models included, so that a field
    added later is covered without a test naming it."""
    for name, f in model.model_fields.items():
        base = f.annotation
        if typing.get_origin(base) is typing.Union:
            base = next(a for a in typing.get_args(base) if a is not type(None))
        if typing.get_origin(base) is typing.Annotated:
            base = typing.get_args(base)[0]
        if isinstance(base, type) and issubclass(base, BaseModel):
            yield from _numeric_fields(base, (*prefix, name))
        elif base in (int, float):
            yield (*prefix, name), base


NUMERIC = [(op, path, kind) for op, model in REQUEST_MODELS.items() for path, kind in _numeric_fields(model)]


def _with(fields: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = dict(fields)
    if len(path) == 1:
        out[path[0]] = value
    else:
        out[path[0]] = _with(out.get(path[0], {}), path[1:], value)
    return out


def test_every_ops_numbers_are_found() -> None:
    found = {(op, ".".join(p)) for op, p, _ in NUMERIC}
    assert {("reserve", "nbytes"), ("ack", "count"), ("ack", "lease.gen"), ("remote_get", "wait_s"),
            ("arena_return", "arena"), ("fallback", "count"), ("hello", "pid")} <= found
    assert set(BASE) == set(REQUEST_MODELS)


@pytest.mark.parametrize("op", sorted(BASE))
def test_the_base_requests_are_well_formed(send, op) -> None:
    reply = send(_frame(op=op, **BASE[op]))
    assert reply["ok"] or reply["error"]["code"] != ErrorCode.BAD_REQUEST.value, reply


@pytest.mark.parametrize("op,path,kind", NUMERIC, ids=[f"{op}.{'.'.join(p)}" for op, p, _ in NUMERIC])
def test_numeric_fields_refuse_lookalikes(send, strict_daemon, op, path, kind) -> None:
    where = ".".join(path)
    for value in NOT_INTS if kind is int else NOT_FLOATS:
        reply = send(_frame(op=op, **_with(BASE[op], path, value)))
        assert reply["ok"] is False and reply["error"]["code"] == "BAD_REQUEST", (where, value, reply)
        assert f"field {where}" in reply["error"]["message"] and reply["id"] == 7, (where, value, reply)
    assert send(_frame())["ok"] is True and strict_daemon.proc.poll() is None


def test_a_float_field_takes_an_int(send) -> None:
    """JSON-minded clients write 2 for 2.0: a number is a number where a float is due."""
    reply = send(_frame(op="remote_get", **_with(BASE["remote_get"], ("wait_s",), 1)))
    assert reply["ok"] or reply["error"]["code"] != "BAD_REQUEST", reply


_V = PROTOCOL_VERSION
ENVELOPE = [
    ("v", float(_V), ErrorCode.BAD_REQUEST), ("v", True, ErrorCode.BAD_REQUEST), ("v", str(_V), ErrorCode.BAD_REQUEST),
    ("v", NAN, ErrorCode.BAD_REQUEST), ("v", [_V], ErrorCode.BAD_REQUEST), ("v", bytes([_V]), ErrorCode.BAD_REQUEST),
    ("v", _V + 1, ErrorCode.UNSUPPORTED_VERSION), ("v", -_V, ErrorCode.UNSUPPORTED_VERSION),
    ("v", (1 << 64) - 1, ErrorCode.UNSUPPORTED_VERSION), ("v", None, ErrorCode.UNSUPPORTED_VERSION),
    ("id", 7.0, ErrorCode.BAD_REQUEST), ("id", True, ErrorCode.BAD_REQUEST), ("id", NAN, ErrorCode.BAD_REQUEST),
    ("id", b"7", ErrorCode.BAD_REQUEST), ("id", [7], ErrorCode.BAD_REQUEST), ("id", "x" * 65, ErrorCode.BAD_REQUEST),
    ("id", {"a": 1}, ErrorCode.BAD_REQUEST),
    ("quiet", 1, ErrorCode.BAD_REQUEST), ("quiet", 0, ErrorCode.BAD_REQUEST), ("quiet", 1.0, ErrorCode.BAD_REQUEST),
    ("quiet", "true", ErrorCode.BAD_REQUEST), ("quiet", None, ErrorCode.BAD_REQUEST),
    ("deadline", NAN, ErrorCode.BAD_REQUEST), ("deadline", INF, ErrorCode.BAD_REQUEST),
    ("deadline", -INF, ErrorCode.BAD_REQUEST), ("deadline", -1, ErrorCode.BAD_REQUEST),
    ("deadline", -0.5, ErrorCode.BAD_REQUEST), ("deadline", True, ErrorCode.BAD_REQUEST),
    ("deadline", False, ErrorCode.BAD_REQUEST), ("deadline", "5", ErrorCode.BAD_REQUEST),
    ("deadline", b"5", ErrorCode.BAD_REQUEST), ("deadline", [5.0], ErrorCode.BAD_REQUEST),
    ("deadline", 0, ErrorCode.TIMED_OUT), ("deadline", 0.0, ErrorCode.TIMED_OUT),
    ("op", 5, ErrorCode.UNKNOWN_OP), ("op", True, ErrorCode.UNKNOWN_OP), ("op", 1.5, ErrorCode.UNKNOWN_OP),
    ("op", b"ping", ErrorCode.UNKNOWN_OP), ("op", None, ErrorCode.UNKNOWN_OP),
]


@pytest.mark.parametrize("key,value,code", ENVELOPE, ids=[f"{k}={v!r}"[:40] for k, v, _ in ENVELOPE])
def test_envelope_keys_refuse_lookalikes(send, strict_daemon, key, value, code) -> None:
    reply = send(_frame(**{key: value}))
    assert reply["ok"] is False and reply["error"]["code"] == code.value, reply
    assert reply["error"]["message"] and reply["id"] == (None if key == "id" else 7), reply
    assert send(_frame())["ok"] is True and strict_daemon.proc.poll() is None


@pytest.mark.parametrize("key,value", [("id", -3), ("id", "x" * 64), ("id", None), ("deadline", 1 << 40),
                                       ("deadline", 1e12), ("deadline", None), ("quiet", False)])
def test_envelope_keys_take_their_types(send, key, value) -> None:
    reply = send(_frame(**{key: value}))
    assert reply["ok"] is True and reply["id"] == (value if key == "id" else 7), reply


def test_a_nan_deadline_is_not_applied(send, strict_daemon) -> None:
    """NaN compares false against every clock reading: taken as a deadline, it would never expire."""
    def fallbacks() -> int:
        return send(_frame(op="stats"))["counters"]["fallbacks"].get("pool_full", 0)

    before = fallbacks()
    reply = send(_frame(op="fallback", reason="pool_full", count=3, deadline=NAN))
    assert reply["error"]["code"] == "BAD_REQUEST" and "finite" in reply["error"]["message"], reply
    assert fallbacks() == before


def test_fd_channel_is_as_strict(strict_daemon) -> None:
    path = str(strict_daemon.runtime_dir / "mmfeatd.fds.sock")
    for v in (4.0, True, "4"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        s.connect(path)
        s.send(msgpack.packb({"v": v, "session": S}))
        reply = msgpack.unpackb(s.recv(4096), raw=False)
        s.close()
        assert reply["error"]["code"] == "UNSUPPORTED_VERSION", (v, reply)
    with strict_daemon.client() as c:
        session = c.session
        session.fd.send_frame(_frame(v=float(_V)))
        session.fd.send_frame(_frame(op="ack", lease=LEASE, count=1.0, quiet=True))
        session.fd.send_frame(_frame(deadline=NAN))
        assert session.fd.sync(5.0)
        assert c.async_failures == {"request BAD_REQUEST": 3}
