"""Hostile and broken clients: every request gets a typed error reply and the daemon keeps serving."""

from __future__ import annotations

import random
import socket
import time
from typing import Iterator

import msgpack
import pytest
import torch
import zmq

from mmfeat.protos import PROTOCOL_VERSION, ErrorCode, MmfeatError

from .conftest import Daemon, assert_fds_settle, daemon_for_bad_input, fd_count


def _raw_to(daemon: Daemon) -> Iterator:
    """A raw DEALER on the daemon's control socket: send frames, get the decoded reply."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"ipc://{daemon.runtime_dir / 'mmfeatd.sock'}")

    def send(*frames: bytes) -> dict:
        sock.send_multipart(list(frames))
        assert sock.poll(5000), "daemon did not reply"
        return msgpack.unpackb(sock.recv(), raw=False)

    yield send
    sock.close()
    ctx.term()


@pytest.fixture
def raw(daemon):
    yield from _raw_to(daemon)


@pytest.fixture(scope="module")
def one_daemon() -> Iterator[Daemon]:
    yield from daemon_for_bad_input("the malformed requests")


@pytest.fixture
def raw_one(one_daemon):
    yield from _raw_to(one_daemon)


def _req(op: str, **fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "id": 7, **fields}, use_bin_type=True)


LEASE = {"pool": 0, "epoch": 1, "lease": 0, "gen": 0, "token": b"t" * 16, "offset": 0, "nbytes": 256}

CASES = [
    ((b"",), ErrorCode.BAD_REQUEST),
    ((b"\xc1",), ErrorCode.BAD_REQUEST),
    ((b"not msgpack at all \xff\xfe",), ErrorCode.BAD_REQUEST),
    ((msgpack.packb([1, 2, 3]),), ErrorCode.BAD_REQUEST),
    ((msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping"}), b"extra frame"), ErrorCode.BAD_REQUEST),
    ((msgpack.packb({"v": 99, "op": "ping", "id": 1}),), ErrorCode.UNSUPPORTED_VERSION),
    ((msgpack.packb({"op": "ping", "id": 1}),), ErrorCode.UNSUPPORTED_VERSION),
    ((_req("format_disk"),), ErrorCode.UNKNOWN_OP),
    ((_req(None),), ErrorCode.UNKNOWN_OP),
    ((_req("reserve"),), ErrorCode.BAD_REQUEST),
    ((_req("reserve", session=b"s" * 16, nbytes=-5),), ErrorCode.BAD_REQUEST),
    ((_req("reserve", session=b"s" * 16, nbytes=1 << 60),), ErrorCode.BAD_REQUEST),
    ((_req("reserve", session=b"s" * 16, nbytes="5"),), ErrorCode.BAD_REQUEST),
    ((_req("reserve", session="s" * 16, nbytes=5),), ErrorCode.BAD_REQUEST),
    ((_req("reserve", session=b"s" * 16, nbytes=5, consumers=0),), ErrorCode.BAD_REQUEST),
    ((_req("reserve", session=b"s" * 16, nbytes=5),), ErrorCode.NOT_FOUND),
    ((_req("ping", quiet=1),), ErrorCode.BAD_REQUEST),
    ((_req("ping", quiet="yes"),), ErrorCode.BAD_REQUEST),
    ((_req("ack", quiet=True, lease=LEASE),), ErrorCode.STALE),  # a quiet request that fails is answered
    ((_req("ack", lease={**LEASE, "token": b"short"}),), ErrorCode.BAD_REQUEST),
    ((_req("ack", lease={**LEASE, "nbytes": 0}),), ErrorCode.BAD_REQUEST),
    ((_req("ack", lease=LEASE, count=-1),), ErrorCode.BAD_REQUEST),
    ((_req("ack", lease=[1, 2]),), ErrorCode.BAD_REQUEST),
    ((_req("ack", lease=LEASE),), ErrorCode.STALE),
    ((_req("publish", lease={**LEASE, "pool": -1}),), ErrorCode.BAD_REQUEST),
    ((_req("fallback", reason="bored"),), ErrorCode.BAD_REQUEST),
    ((_req("hello", name="x" * 1000),), ErrorCode.BAD_REQUEST),
    ((b"\x81" + b"\xa1v" + b"\xce\xff\xff\xff\xff",), ErrorCode.UNSUPPORTED_VERSION),
    ((b"x" * (100 * 1024),), ErrorCode.TOO_LARGE),
    ((msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": 1, "pad": b"\x00" * (70 * 1024)}),),
     ErrorCode.TOO_LARGE),
]


@pytest.mark.parametrize("frames,code", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_typed_error_reply(raw_one, one_daemon, frames, code) -> None:
    reply = raw_one(*frames)
    assert reply["ok"] is False and reply["error"]["code"] == code.value, reply
    assert reply["error"]["message"]
    assert raw_one(_req("ping"))["ok"] is True and one_daemon.proc.poll() is None


def test_fuzzed_frames_never_kill_the_daemon(daemon, raw) -> None:
    rng = random.Random(1234)
    before = fd_count(daemon.pid)
    for i in range(400):
        if i % 2:
            blob = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        else:  # structurally valid msgpack with wrong shapes and types
            value = rng.choice([None, True, -1, 2**63 - 1, 1.5, "x", b"y" * 16, [1, "a"], {"k": b""}])
            fields = {rng.choice(["session", "nbytes", "lease", "count", "consumers", "reason", "name"]): value
                      for _ in range(3)}
            blob = _req(rng.choice(["reserve", "ack", "publish", "release", "lookup", "hello", "fallback", "stats"]),
                        **fields)
        reply = raw(blob)
        assert reply.get("ok") in (True, False)
        if reply["ok"] is False:
            assert reply["error"]["code"] in {c.value for c in ErrorCode}
    s = daemon.stats()
    assert s["counters"]["bad_requests"] > 100
    assert s["pools"][0]["used"] == 0 and s["sessions"] <= 200
    assert_fds_settle(daemon.pid, before + 1)  # +1: the fuzzing DEALER itself


def test_fd_channel_garbage_and_strangers(daemon) -> None:
    path = str(daemon.runtime_dir / "mmfeatd.fds.sock")
    before = fd_count(daemon.pid)

    def exchange(payload: bytes) -> dict | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        s.connect(path)
        s.send(payload)
        data, fds, _, _ = socket.recv_fds(s, 4096, 4)
        assert fds == [], "fds handed to an unauthenticated peer"
        s.close()
        return msgpack.unpackb(data, raw=False) if data else None

    assert exchange(b"\xc1\xc1")["error"]["code"] == "BAD_REQUEST"
    assert exchange(msgpack.packb({"v": 9}))["error"]["code"] == "UNSUPPORTED_VERSION"
    assert exchange(msgpack.packb({"v": PROTOCOL_VERSION, "session": "str"}))["error"]["code"] == "BAD_REQUEST"
    assert exchange(msgpack.packb({"v": PROTOCOL_VERSION, "session": b"x" * 16}))["error"]["code"] == "NOT_FOUND"
    for _ in range(20):  # connect and vanish
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        s.close()
    with daemon.client(inline_threshold=0) as c:  # a real client still gets its pools
        import torch

        d = c.put(torch.ones(1000))
        assert c.get(d).sum().item() == 1000
        c.ack(d)
    assert_fds_settle(daemon.pid, before)


def test_second_fd_channel_for_one_session_is_refused(daemon) -> None:
    with daemon.client() as c:
        session = c.session
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        s.connect(str(daemon.runtime_dir / "mmfeatd.fds.sock"))
        s.send(msgpack.packb({"v": PROTOCOL_VERSION, "session": session.token}))
        data, fds, _, _ = socket.recv_fds(s, 4096, 4)
        assert fds == [] and msgpack.unpackb(data)["error"]["code"] == "BAD_STATE"
        s.close()


def test_uid_not_allowed_is_refused(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "16", env={"MMFEAT_ALLOWED_UIDS": "54321", "MMFEAT_ALLOWED_GIDS": "54321"})
    with d.client(inline_threshold=0, fallback="error") as c:
        with pytest.raises(MmfeatError) as info:
            c.session
        assert info.value.code is ErrorCode.FORBIDDEN and "allowed_uids" in info.value.message


def test_a_quiet_request_that_succeeds_gets_no_reply(daemon) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"ipc://{daemon.runtime_dir / 'mmfeatd.sock'}")
    try:
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": 1, "quiet": True}))
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": 2, "quiet": False}))
        assert sock.poll(5000)
        assert msgpack.unpackb(sock.recv())["id"] == 2, "the quiet ping was answered"
        assert not sock.poll(200)
    finally:
        sock.close()


def test_floods_of_hellos_and_silent_connections_are_bounded(daemon, raw) -> None:
    from mmfeat.daemon.sockets.fd_channel import MAX_PENDING_HANDSHAKES
    from mmfeat.daemon.leases.sessions import MAX_PENDING_SESSIONS

    before = fd_count(daemon.pid)
    replies = [raw(_req("hello")) for _ in range(MAX_PENDING_SESSIONS + 5)]
    assert all(r["ok"] for r in replies), "a hello flood must not lock later clients out"
    s = daemon.stats()
    assert s["sessions"] == MAX_PENDING_SESSIONS and s["counters"]["sessions_dropped"] == 5
    # The oldest waiting sessions made room: presenting one on the fd channel is NOT_FOUND.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(str(daemon.runtime_dir / "mmfeatd.fds.sock"))
        s.send(msgpack.packb({"v": PROTOCOL_VERSION, "session": replies[0]["session"]}))
        data, fds, _, _ = socket.recv_fds(s, 4096, 4)
        assert fds == [] and msgpack.unpackb(data)["error"]["code"] == "NOT_FOUND"
    with daemon.client(inline_threshold=0) as c:  # a real client gets in during the flood
        desc = c.put(torch.ones(1000))
        assert c.get(desc).sum().item() == 1000
        c.ack(desc)
    silent = []
    for _ in range(MAX_PENDING_HANDSHAKES + 50):  # connect, never say anything
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(str(daemon.runtime_dir / "mmfeatd.fds.sock"))
        silent.append(s)
    for s in silent:
        s.setblocking(False)
    try:
        closed: set[int] = set()
        deadline = time.monotonic() + 60  # the daemon accepts them as fast as a loaded machine lets it
        while len(closed) < 50:
            for i, s in enumerate(silent):  # the daemon drops the oldest ones
                try:
                    if i not in closed and s.recv(1) == b"":
                        closed.add(i)
                except BlockingIOError:
                    pass
            assert time.monotonic() < deadline, f"only {len(closed)} silent connections were dropped"
            time.sleep(0.05)
        assert fd_count(daemon.pid) <= before + MAX_PENDING_HANDSHAKES + 2
    finally:
        for s in silent:
            s.close()
    assert_fds_settle(daemon.pid, before + 1)
    assert daemon.stop() == 0
    err = daemon.proc.communicate()[1]
    # Named once (rate-limited), with the hello's own name and pid, so an operator can find the client.
    assert err.count("fd channel: dropped the oldest") == 1 and "pid 0" in err, err[-2000:]
