"""Keyed and retained features, the client's part: puts that the daemon learns the key of, lookups by
key, holds and eviction (SPEC.md, section 3, "Keys and lifetimes").

A keyed or retained put waits for the daemon by default: it takes a reserve (which answers the live
feature at once when the key has one: no byte is copied) and a publish by the lease's deadline
(client/produce/in_time.py) that, under a key, waits for its reply (which answers the live feature when
another producer published under the key meanwhile: this one's bytes are let go).

With ``wait=False`` it waits for nothing: the feature goes into one of the session's arenas as an
unkeyed one does (a retained one with the CONSUMERS word no ack reaches), and one quiet ``bind`` on the
fd channel, in the daemon's socket buffer when put returns, carries its key and lifetime. A lookup made
after put returned finds it (the daemon reads what waits on its fd channels before it answers a miss).
Where the key names a live feature already, the key keeps naming that one and this feature stays,
unkeyed, readable by the descriptor put returned for its own lifetime. A feature no arena takes is
reserved under no key (the one round trip it waits for), and its publish and bind follow pipelined.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Optional, Union

import torch

from mmfeat.protos.descriptor import Descriptor, DescriptorError
from mmfeat.protos.errors import DaemonUnavailableError, ErrorCode, MmfeatError
from mmfeat.protos.keys import check_key, check_keys
from mmfeat.protos.lease_table import ACK_COUNT_MASK, GEN_MASK, PUBLISHED
from mmfeat.protos.messages import MAX_CONSUMERS, MAX_KEPT_DESCRIPTOR_BYTES, MAX_RETAIN_TTL_S, TOKEN_BYTES, \
    FallbackReason, HoldKeysReply, HoldReply, LookupKeyReply, PoolInfo

from ..link.channel import ControlChannel
from ..link.session import Session
from . import packing
from .in_time import lease_life, publish_in_time
from .producer import Producer, _write, check_consumers
from .put_in_flight import PutInFlight


def check_lifetime(key: Optional[str], retain_ttl: Optional[float], consumers: int) -> dict[str, Any]:
    """The reserve fields of a keyed or retained put ({} for neither); BAD_REQUEST for a bad key, ValueError
    for a bad TTL or a consumer count given with one."""
    fields: dict[str, Any] = {}
    if key is not None:
        fields["key"] = check_key(key)
    if retain_ttl is not None:
        if (isinstance(retain_ttl, bool) or not isinstance(retain_ttl, (int, float)) or not math.isfinite(retain_ttl)
                or not 0 < retain_ttl <= MAX_RETAIN_TTL_S):
            raise ValueError(f"retain_ttl must be seconds in (0, {MAX_RETAIN_TTL_S:g}], not {retain_ttl!r}")
        if consumers != 1:
            raise ValueError("a retained feature counts no consumers: give retain_ttl or consumers, not both "
                             "(its readers are protected by hold(key, count=...))")
        fields["retain_ttl"] = float(retain_ttl)
    return fields


class KeyedPuts:
    """put and put_many with a key or a retain_ttl."""

    def __init__(self, producer: Producer) -> None:
        self._p = producer

    def put(self, tensors: list[torch.Tensor], many: bool, consumers: int, keyed: dict[str, Any],
            wait: bool = True) -> Descriptor:
        p = self._p
        check_consumers(consumers)  # as put's: the daemon's refusal would come as BAD_REQUEST, after a round trip
        specs, nbytes = packing.layout(tensors)
        device = next((t.device.index for t in tensors if t.is_cuda), None)
        put = PutInFlight(specs, nbytes, many, consumers, device, tensors)
        if nbytes == 0:
            return p._inline(put, FallbackReason.BELOW_THRESHOLD, "")  # no lease holds zero bytes
        if p._fallbacks.daemon_down:
            exc = DaemonUnavailableError(f"mmfeatd at {p._channel.endpoint} stopped answering; probing it once a "
                                         "second")
            return p._fallback_or_raise(put, FallbackReason.UNREACHABLE, exc)
        writing: list[Session] = []
        try:
            if not wait:
                desc = self._in_arena(put, device, keyed, writing)
                if desc is not None:
                    return desc
            return self._in_pool(put, device, keyed, writing, wait)
        except MmfeatError as exc:
            # As put's: a pool with no room even after evicting what nothing held means inline, and no
            # key finds that feature.
            return p.fall_back(put, exc)
        finally:
            for s in writing:
                s.end_write()

    def _in_arena(self, put: PutInFlight, device: Optional[int], keyed: dict[str, Any],
                  writing: list[Session]) -> Optional[Descriptor]:
        """The feature placed and published in one of the session's arenas, its key and lifetime bound by
        one quiet message on the fd channel; None where the daemon takes no bind or no arena has room
        (the caller then reserves, and waits)."""
        p = self._p
        session = p._writing_in(p._connect(), writing)
        if not session.binds or session.arenas is None:
            return None
        pool, pool_tensor = p._target(session, device)
        if "key" in keyed:
            check_kept_descriptor(put, session, p._channel.endpoint, pool)
        desc = p._put_in_arena(session, pool, put, pool_tensor, ACK_COUNT_MASK if "retain_ttl" in keyed else None,
                               keyed=True)
        if desc is None:
            return None
        fields = {"lease": desc.lease_ref(), **keyed}
        if "key" in keyed:
            fields["descriptor"] = desc.to_bytes()
        # Its failure (a refusal) is counted and logged when the channel is next read (Client.async_failures).
        session.fd.send("bind", **fields)
        return desc

    def _in_pool(self, put: PutInFlight, device: Optional[int], keyed: dict[str, Any],
                 writing: list[Session], wait: bool = True) -> Descriptor:
        """A reserved lease. Without ``wait`` (where the daemon takes bind) it is reserved under no key and
        published pipelined, and its key goes in a bind after the publish: one waited round trip, the
        reserve, and the same outcome as in an arena under a live key."""
        p = self._p
        session = p._writing_in(p._connect(), writing)
        pool, _ = p._target(session, device)
        if "key" in keyed:
            check_kept_descriptor(put, session, p._channel.endpoint, pool)
        bind = not wait and session.binds and "key" in keyed
        reserved = {"retain_ttl": keyed["retain_ttl"]} if bind and "retain_ttl" in keyed else {} if bind else keyed
        asked_at = time.monotonic()  # before the request: the deadline here is never later than the daemon's
        session, reply = p._reserve(session, pool, put, writing, reserved)
        if reply.descriptor is not None:
            return Descriptor.from_bytes(reply.descriptor)  # the key's live feature: nothing was reserved
        deadline = asked_at + lease_life(reply.expires_in, session)
        lease = reply.lease
        desc = put.descriptor(session, p._channel.endpoint, lease.pool, lease.lease, lease.gen, lease.token,
                              lease.offset)
        try:
            try:
                pool_tensor = p._pool_tensor(session, desc.pool, device)
            except (RuntimeError, OSError) as exc:
                p._release_quietly(session, desc)
                return p._fallback_or_raise(put, FallbackReason.MAP_FAILED, exc)
            _write(pool_tensor, desc.offset, put, session.ready_ttl)
        except BaseException:
            p._release_quietly(session, desc)
            raise
        desc = publish_in_time(session, desc, asked_at, deadline, _late, key="key" in reserved)
        if bind:  # behind the publish on the same channel: the daemon handles it after
            session.fd.send("bind", lease=desc.lease_ref(), key=keyed["key"], descriptor=desc.to_bytes())
        return desc


def check_kept_descriptor(put: PutInFlight, session: Session, endpoint: str, pool: PoolInfo) -> None:
    """Refuse a keyed feature whose descriptor the daemon could not keep for lookups by key (over
    MAX_KEPT_DESCRIPTOR_BYTES), before anything is reserved: its publish would be refused only after
    the write. Measured with the largest slot, generation and offset the daemon could grant, so that no
    grant makes the real one longer."""
    longest = put.descriptor(session, endpoint, pool.pool, session.table.slots, GEN_MASK, bytes(TOKEN_BYTES),
                             pool.size)
    size = len(longest.to_bytes())
    if size > MAX_KEPT_DESCRIPTOR_BYTES:
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"the descriptor of this keyed feature of {len(put.specs)} tensors "
                          f"takes up to {size} B, over the {MAX_KEPT_DESCRIPTOR_BYTES} B the daemon keeps per key "
                          "for lookups: put fewer tensors per keyed feature (several keys), or put it without a "
                          "key; nothing was placed")


def _late(why: str) -> MmfeatError:
    said = f" ({why})" if why else ""
    return MmfeatError(ErrorCode.STALE, f"the feature's reserved lease ended before its publish{said}: the daemon's "
                       "reserve_ttl is shorter than this put's copy; raise reserve_ttl and put again")


class KeyLookups:
    """has, has_many, lookup, hold, hold_many and evict: control requests, which need no pool."""

    def __init__(self, channel: ControlChannel, connect: Any) -> None:
        self._channel = channel
        self._connect = connect

    def has_many(self, keys: list[str]) -> list[bool]:
        keys = check_keys(keys)
        if not keys:
            return []
        return list(LookupKeyReply.from_wire(self._channel.call("lookup_key", keys=keys)).found)

    def lookup(self, key: str) -> Optional[Descriptor]:
        reply = LookupKeyReply.from_wire(self._channel.call("lookup_key", keys=[check_key(key)], descriptors=True))
        data = reply.descriptors[0] if reply.descriptors else None
        return Descriptor.from_bytes(data) if data is not None else None

    def hold(self, target: Union[str, Descriptor], count: int) -> Optional[Descriptor]:
        _check_count(count)
        session: Session = self._connect()
        fields: dict[str, Any] = {"session": session.token, "count": count}
        if isinstance(target, str):
            fields["key"] = check_key(target)
        else:
            if target.is_inline:
                raise MmfeatError(ErrorCode.BAD_REQUEST, "an inline descriptor is no feature of the pool: nothing "
                                  "to hold")
            fields["lease"] = target.lease_ref()
        try:
            reply = HoldReply.from_wire(self._channel.call("hold", **fields))
        except MmfeatError as exc:
            if exc.code in (ErrorCode.NOT_FOUND, ErrorCode.STALE) and (isinstance(target, str) or session.alive()):
                return None  # the feature is gone (a restart forgets every key)
            raise
        if reply.descriptor is not None:
            return Descriptor.from_bytes(reply.descriptor)
        assert not isinstance(target, str)
        ref = reply.lease
        return dataclasses.replace(target, lease=ref.lease, gen=ref.gen, token=ref.token)

    def evict(self, key: str) -> bool:
        return bool(self._channel.call("evict", key=check_key(key))["evicted"])

    def hold_keys(self, keys: list[str], count: int, timeout: Optional[float], feed: bool = False,
                  feed_wait: float = 0.0) -> list[Optional[tuple[Descriptor, bool]]]:
        """Per key, None or ``(descriptor, held)``. ``feed``: the session's key feed hints at each key's
        descriptor (waited for ``feed_wait`` seconds where it has not brought one yet), checked here in
        the lease table: a retained feature found there is pinned for ``count`` reads
        (held), a counted one live there answered as it is, each without a message; the other keys go in
        one ``hold_keys`` round trip."""
        keys = check_keys(keys)
        _check_count(count)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < math.inf):
            raise ValueError(f"timeout must be None or a finite number of seconds > 0, not {timeout!r}")
        if isinstance(feed_wait, bool) or not isinstance(feed_wait, (int, float)) or not 0 <= feed_wait < math.inf:
            raise ValueError(f"feed_wait must be a finite number of seconds >= 0, not {feed_wait!r}")
        if not keys:
            return []
        session: Session = self._connect()
        out: list[Optional[tuple[Descriptor, bool]]] = [None] * len(keys)
        ask = list(range(len(keys)))
        find = session.feed.find if feed and session.feed is not None else None
        if find is not None and session.pins and session.table.writable:
            ask = []
            for i, key in enumerate(keys):
                out[i] = _pinned(session, find(key), count)
                if out[i] is None:
                    ask.append(i)
            if ask and feed_wait > 0 and session.feed.wait_for([keys[i] for i in ask], feed_wait):
                for i in list(ask):
                    out[i] = _pinned(session, find(keys[i]), count)
                    if out[i] is not None:
                        ask.remove(i)
            if not ask:
                return out
        try:
            reply = HoldKeysReply.from_wire(self._channel.call("hold_keys", timeout=timeout, session=session.token,
                                                               keys=[keys[i] for i in ask], count=count))
        except MmfeatError as exc:
            if exc.code is ErrorCode.NOT_FOUND:
                return out  # a session from before a daemon restart, which forgot every key
            for i in range(len(keys)):
                if i not in ask and out[i] is not None and out[i][1]:
                    _unpin(session, out[i][0], count)  # all or none, as the daemon's answer
            raise
        for i, d, held in zip(ask, reply.descriptors, reply.held):
            out[i] = None if d is None else (Descriptor.from_bytes(d), held)
        return out


def _pinned(session: Session, blob: Optional[bytes], count: int) -> Optional[tuple[Descriptor, bool]]:
    """The feed's descriptor ``blob`` if the lease table shows it live on this node in this epoch: a
    retained feature pinned for ``count`` reads (held), a counted one as it is; None otherwise (stale,
    another node's, not pinnable), and the caller asks the daemon."""
    if not blob:
        return None
    try:
        desc = Descriptor.from_bytes(blob)
    except DescriptorError:
        return None
    if desc.is_inline or desc.epoch != session.epoch or desc.node != session.node:
        return None
    table = session.table
    if table.pin(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes, count):
        return desc, True
    # Not pinned: a counted feature (its consumer count protects its readers), or one to ask about.
    if (not table.retained(desc.lease, desc.gen)
            and table.state(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes) == PUBLISHED):
        return desc, False
    return None


def _unpin(session: Session, desc: Descriptor, count: int) -> None:
    """Release the ``count`` reads of a pin taken for a request the daemon then refused."""
    session.table.add_acks(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes, count)


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_CONSUMERS:
        raise ValueError(f"count must be an int between 1 and {MAX_CONSUMERS}, not {count!r}")
