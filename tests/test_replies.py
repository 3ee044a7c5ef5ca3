"""Replies have one type per op (protos/messages.py, REPLY_TYPES): what a real daemon sends for each op
reads as that type at the client, and the type writes back exactly those bytes' fields, so the two ends
read the same contract. A reply that is not what the type says is a typed error at the read."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mmfeat.protos import ErrorCode, MmfeatError
from mmfeat.protos.messages import REPLY_TYPES, AckReply, HelloReply, LeaseReply

_ENVELOPE = ("v", "id", "ok")


def _roundtrip(op: str, body: dict[str, Any]) -> Any:
    reply = REPLY_TYPES[op].from_wire(body)
    assert reply.to_wire() == {k: v for k, v in body.items() if k not in _ENVELOPE}, op
    return reply


def test_every_ops_reply_from_a_real_daemon_reads_as_its_type(daemon) -> None:
    seen = set()
    with daemon.client() as c:
        session = c.session
        ch, fd = c._channel, session.fd

        def call(op: str, via: Any = ch, **fields: Any) -> Any:
            seen.add(op)
            return _roundtrip(op, via.call(op, **fields))

        hello = call("hello", name="replies")
        assert isinstance(hello, HelloReply) and hello.pools and hello.pools[0].pool == 0
        reserved = call("reserve", session=session.token, nbytes=4096, consumers=1)
        assert isinstance(reserved, LeaseReply) and reserved.state == "RESERVED"
        ref = reserved.lease.to_wire()
        assert call("publish", via=fd, lease=ref).state == "PUBLISHED"
        assert call("lookup", lease=ref).remaining == 1
        ack = call("ack", via=fd, lease=ref, count=1, ack_id=b"a" * 8)
        assert isinstance(ack, AckReply) and ack.freed and ack.duplicate is False
        other = call("reserve", session=session.token, nbytes=4096).lease.to_wire()
        assert call("release", via=fd, lease=other).freed is True
        grant = call("arena", via=fd).arena
        call("arena_return", via=fd, arena=grant.id)
        call("fallback", reason="pool_full")
        assert call("ping", via=fd).epoch == hello.epoch
        assert call("stats").node == hello.node
        assert call("pool_info").pools == hello.pools
        # Keys and lifetimes: a keyed retained lease, looked up, held, acked, evicted.
        from mmfeat.client import Namespace

        key = Namespace("replies", "1", "m", "uint8").key("k")
        desc = c.put(torch.ones(10000), key=key, retain_ttl=60.0)
        found = call("lookup_key", keys=[key], descriptors=True)
        assert found.found == (True,) and found.descriptors == (desc.to_bytes(),)
        held = call("hold", session=c.session.token, key=key, count=1)
        assert held.descriptor is not None and held.lease.lease != desc.lease
        call("ack", via=c.session.fd, lease=held.lease.to_wire())
        # A counted feature put in the arena, then given a key by bind; both keys looked up and held at once.
        counted = c.put(torch.ones(1 << 16))
        other = Namespace("replies", "1", "m", "uint8").key("bound")
        bound = call("bind", via=c.session.fd, lease=counted.lease_ref(), key=other, descriptor=counted.to_bytes())
        assert bound.state == "PUBLISHED" and bound.descriptor == counted.to_bytes()
        both = call("hold_keys", session=c.session.token, keys=[key, other], count=1)
        assert both.held == (True, False) and both.descriptors[1] == counted.to_bytes()
        c.ack(both.descriptors[0])
        c.ack(counted)
        assert call("evict", key=key).evicted is True
    # remote_get needs a second node: tests/test_remote.py reads its replies through the client.
    assert seen == set(REPLY_TYPES) - {"remote_get"}


@pytest.mark.parametrize("body, problem", [
    ({"remaining": 0, "freed": True}, "lacks field over_acked"),
    ({"remaining": 0, "freed": 1, "over_acked": 0}, "has freed = int, not bool"),
    ([0, True, 0], "is a list, not a map"),
])
def test_a_reply_that_is_not_its_type_is_a_typed_error(body: Any, problem: str) -> None:
    with pytest.raises(MmfeatError) as info:
        AckReply.from_wire(body)
    assert info.value.code is ErrorCode.INTERNAL and problem in info.value.message


def test_a_lease_reply_with_a_malformed_lease_is_a_typed_error() -> None:
    lease = {"pool": 0, "epoch": 1, "lease": 2, "gen": 3, "token": "not bytes", "offset": 0, "nbytes": 8}
    with pytest.raises(MmfeatError, match="token = str, not bytes"):
        LeaseReply.from_wire({"lease": lease, "state": "RESERVED", "consumers": 1, "remaining": 1})


def test_both_transports_send_a_quiet_request_and_count_its_failure_under_its_op(daemon) -> None:
    """The control channel and the fd channel are one interface (client/link/transport.py): ``send`` is a
    quiet request on either, and its error reply, read by a later call, is counted under the op."""
    lease = {"pool": 0, "epoch": 0, "lease": 1 << 20, "gen": 0, "token": b"t" * 16, "offset": 0, "nbytes": 1}
    with daemon.client() as c:
        for transport in (c._channel, c.session.fd):
            transport.send("release", session=c.session.token, lease=lease)
            transport.call("ping")  # answered after the release: its error reply is in by now
        assert c.async_failures == {"release STALE": 2}
