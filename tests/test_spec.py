"""protos/SPEC.md and the code stay in step: version, every op, every error code, every counter."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mmfeat.daemon.leases.counters import Counters
from mmfeat.daemon.handlers import HANDLERS
from mmfeat.protos import HANDLE_KINDS, POOL_KINDS, PROTOCOL_VERSION, REQUEST_MODELS, ErrorCode
from mmfeat.protos.dtypes import DTYPE_SIZES
from mmfeat.protos.messages import FallbackReason

SPEC = (Path(__file__).parent.parent / "protos" / "SPEC.md").read_text()


def test_version_matches() -> None:
    assert re.search(r"Protocol version: \*\*(\d+)\*\*", SPEC).group(1) == str(PROTOCOL_VERSION)
    assert f"must equal {PROTOCOL_VERSION}" in SPEC


def test_every_op_is_documented_and_handled() -> None:
    documented = set(re.findall(r"^### (\w+)$", SPEC, re.M)) - {"The"}
    assert documented == set(REQUEST_MODELS) == set(HANDLERS)


def test_every_request_field_is_documented() -> None:
    for op, model in REQUEST_MODELS.items():
        section = SPEC.split(f"### {op}\n", 1)[1].split("\n### ", 1)[0]
        for name in model.model_fields:
            assert f"`{name}`" in section, f"field {name} of {op} is not in SPEC.md"


def test_every_error_code_is_documented() -> None:
    table = set(re.findall(r"^\| `([A-Z_]+)` \|", SPEC, re.M))
    assert table == {c.value for c in ErrorCode}


def test_counters_fallback_reasons_and_dtypes_are_documented() -> None:
    for name in Counters().as_dict():
        assert name in SPEC, name
    for reason in FallbackReason:
        assert f"`{reason.value}`" in SPEC
    for kind in (*POOL_KINDS, *HANDLE_KINDS):
        assert f'"{kind}"' in SPEC or f"`{kind}`" in SPEC, kind
    for dtype in DTYPE_SIZES:
        assert re.search(rf"\b{dtype}\b", SPEC), dtype


def test_shared_layouts_are_documented_as_the_code_defines_them() -> None:
    from dataclasses import fields

    from mmfeat.protos import lease_table
    from mmfeat.protos.handshake import ArenaGrant

    shared = SPEC.split("## 5. ", 1)[1].split("\n## 6. ", 1)[0]
    assert f"`{lease_table.MAGIC.decode()}`" in shared
    per_slot = lease_table.COLUMN_BYTES + lease_table.ENTRY_BYTES
    assert f"`{lease_table.HEADER_BYTES} + {per_slot} × table_slots`" in shared
    assert lease_table.table_bytes(10) == lease_table.HEADER_BYTES + 10 * (24 + lease_table.ENTRY_BYTES)
    for column, at in (("STATE", 0), ("ACKS", 8), ("READY", 16)):
        offset = lease_table.word_offset(10, 0, getattr(lease_table, column))
        assert offset == lease_table.HEADER_BYTES + at * 10
        assert f"The `{column}` column at byte `64{f' + {at} × table_slots' if at else ''}`" in shared, column
    assert lease_table.word_offset(10, 0, lease_table.POOL) == lease_table.HEADER_BYTES + 24 * 10
    assert "The entries at byte `64 + 24 × table_slots`" in shared
    assert lease_table.NOT_READY == 2**64 - 1 and "2^64 - 1, ready for no generation" in shared
    words = ["STATE", "ACKS", "POOL", "OFFSET", "NBYTES", "CONSUMERS", "TOKEN"]
    assert [getattr(lease_table, w) for w in words] == list(range(len(words)))
    for w in words:
        assert f"`{w}`" in shared, w
    assert (lease_table.FREE, lease_table.RESERVED, lease_table.PUBLISHED, lease_table.DONE) == (0, 1, 2, 3)
    assert "(0 free, 1 RESERVED,\n  2 PUBLISHED, 3 DONE:" in shared
    assert lease_table.LIVE_STATES == (lease_table.RESERVED, lease_table.PUBLISHED)
    arena = SPEC.split("### arena\n", 1)[1].split("\n### ", 1)[0]
    assert "`{" + ", ".join(f.name for f in fields(ArenaGrant)) + "}`" in arena.replace("\n", " ")
    for line in (f"{{v: {PROTOCOL_VERSION}, session: ",
                 f"{{v: {PROTOCOL_VERSION}, ok: true, pools: [pool ids], table: true}}"):
        assert line in SPEC, line


def test_the_mesh_is_documented_as_the_code_defines_it() -> None:
    from mmfeat.protos import mesh

    section = SPEC.split("## 11. The mesh", 1)[1]
    assert f"Mesh version:\n**{mesh.MESH_VERSION}**" in section or f"Mesh version: **{mesh.MESH_VERSION}**" in section
    for op, model in mesh.MESH_OPS.items():
        row = next((line for line in section.splitlines() if line.startswith(f"| `{op}` |")), None)
        assert row is not None, f"mesh op {op} is not in SPEC.md section 11"
        for name in model.model_fields:
            assert f"`{name}`" in row, f"field {name} of mesh op {op} is not in its row"
    for name in mesh.MeshPool.model_fields:
        assert name in section, name
    assert f"{mesh.MAX_MESH_FRAME >> 10} KiB" in section


def test_request_and_reply_frames_are_the_documented_envelope() -> None:
    """Both ends make and read frames with protos/envelope.py: these bytes are SPEC.md's section 2, key
    for key and in order, so a change to that module is a change to the wire this test shows."""
    import msgpack

    from mmfeat.protos.envelope import checked_reply, error_frame, ok_frame, request_frame, split_request
    from mmfeat.protos.errors import MmfeatError

    v = PROTOCOL_VERSION
    lease = {"pool": 0, "epoch": 1, "lease": 2, "gen": 3, "token": b"t" * 16, "offset": 256, "nbytes": 8}
    assert request_frame("ack", 7, {"lease": lease}, deadline=5.5) == msgpack.packb(
        {"v": v, "op": "ack", "id": 7, "deadline": 5.5, "lease": lease}, use_bin_type=True)
    assert request_frame("release", "release", {"lease": lease}, quiet=True) == msgpack.packb(
        {"v": v, "op": "release", "id": "release", "quiet": True, "lease": lease}, use_bin_type=True)
    assert ok_frame(7, {"remaining": 0}) == msgpack.packb({"remaining": 0, "v": v, "id": 7, "ok": True})
    assert error_frame(None, ErrorCode.STALE, "m") == msgpack.packb(
        {"v": v, "id": None, "ok": False, "error": {"code": "STALE", "message": "m"}})

    env, fields = split_request(msgpack.unpackb(request_frame("ack", 7, {"lease": lease}, quiet=True, deadline=1.0)))
    assert (env.op, env.id, env.quiet, env.deadline, fields) == ("ack", 7, True, 1.0, {"lease": lease})
    assert checked_reply(msgpack.unpackb(ok_frame(7, {"freed": True})))["freed"] is True
    try:
        checked_reply(msgpack.unpackb(error_frame(7, ErrorCode.STALE, "restarted")))
    except MmfeatError as exc:
        assert (exc.code, exc.message) == (ErrorCode.STALE, "restarted")
    else:
        raise AssertionError("an error reply read as a success")


def test_every_reply_field_is_documented() -> None:
    """As each request field is: each op's reply type (protos/messages.py) has every field named in the
    op's section, or in the one it refers to ("as reserve", "as in hello", "a lease reference")."""
    from mmfeat.protos.messages import REPLY_TYPES

    def section(title: str) -> str:
        return SPEC.split(f"### {title}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]

    assert set(REPLY_TYPES) == set(REQUEST_MODELS)
    for op, reply in REPLY_TYPES.items():
        text = section(op)
        refers = (("as reserve", "reserve"), ("as in hello", "hello"), ("lease reference", "The lease reference"))
        for phrase, other in refers:
            if phrase in text:
                text += section(other)
        for name in reply._WIRE:
            assert f"`{name}`" in text, f"field {name} of {op}'s reply is not in SPEC.md"
        for name, nested in {**reply._NESTED, **reply._ITEMS}.items():
            for sub in getattr(nested, "_WIRE", None) or nested.__dataclass_fields__:
                assert re.search(rf"\b{sub}\b", text), f"field {name}.{sub} of {op}'s reply is not in SPEC.md"


_TRANSPORT_ARGS = {"timeout", "quiet", "req_id"}  # arguments of the client's transports, not wire fields


def _request_keys(function: ast.AST) -> dict[str, set[str]]:
    """op -> the request fields one client function sends with it: the keywords of each transport call
    (``x.call("op", key=...)``, ``send``, ``call_later``), and for a ``**name`` the keys the function puts
    into ``name`` (a dict literal, ``name["key"] = ...``)."""
    built: dict[str, set[str]] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    built.setdefault(target.id, set()).update(
                        k.value for k in node.value.keys if isinstance(k, ast.Constant))
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and isinstance(target.slice, ast.Constant)):
                    built.setdefault(target.value.id, set()).add(target.slice.value)
        if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Dict) and isinstance(node.target, ast.Name):
            built.setdefault(node.target.id, set()).update(
                k.value for k in node.value.keys if isinstance(k, ast.Constant))
    sent: dict[str, set[str]] = {}
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("call", "send", "call_later") and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            continue
        keys = sent.setdefault(node.args[0].value, set())
        for kw in node.keywords:
            if kw.arg is not None:
                keys.add(kw.arg)
            elif isinstance(kw.value, ast.Name):
                keys |= built.get(kw.value.id, set())
    return sent


def test_every_key_the_client_sends_is_a_field_of_its_requests_model() -> None:
    """Request fields are spelt once, in protos/messages.py: the daemon ignores a key its model does not
    name (SPEC.md, section 2), so a key the client spells otherwise would be dropped without a word."""
    offenders, seen = [], set()
    for path in sorted((Path(__file__).parent.parent / "client").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for op, keys in _request_keys(node).items():
                seen.add(op)
                model = REQUEST_MODELS.get(op)
                if model is None:
                    offenders.append(f"{path.name}:{node.name} sends op {op!r}, which protos does not define")
                    continue
                for key in sorted(keys - _TRANSPORT_ARGS - set(model.model_fields)):
                    offenders.append(f"{path.name}:{node.name} sends {op}.{key}, not a field of {model.__name__}")
    assert not offenders, offenders
    assert {"reserve", "ack", "arena", "hello", "publish", "release"} <= seen, f"the check found only {sorted(seen)}"
