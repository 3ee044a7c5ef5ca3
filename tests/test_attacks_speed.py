"""Attacks on the fast paths of put, get, ack and the descriptor's caches: a receive buffer reused for the
next feature, a parse cache that would hold a large buffer, and descriptors built by hand with odd or
mutable fields."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import msgpack
import numpy as np
import torch

from mmfeat.protos import Descriptor
from mmfeat.protos import descriptor
from mmfeat.protos.descriptor import TensorSpec

BIG = 1 << 62  # an inline_threshold no feature reaches: every put goes inline


def _packb(d: Descriptor) -> bytes:
    """What msgpack makes of the descriptor's fields as they are: what to_bytes must write."""
    return msgpack.packb([1, d.kind, d.node, d.endpoint, d.device, d.pool, d.epoch, d.lease, d.gen, d.token,
                          d.offset, d.nbytes, d.many, [t.to_wire() for t in d.tensors], d.inline],
                         use_bin_type=True)


def test_a_receive_buffer_refilled_with_the_next_feature_is_parsed_again(daemon) -> None:
    """A consumer that receives each message into the same writable buffer, then gets and acks from it,
    reads the feature now in the buffer: its dtype and shape, not those of the one received before."""
    with daemon.client(inline_threshold=BIG) as c:
        first = c.put(torch.full((4096,), 7, dtype=torch.uint8)).to_bytes()
        second = c.put(torch.arange(2048, dtype=torch.int16)).to_bytes()
        assert len(first) == len(second)  # one buffer holds either, as a recv_into buffer would
        buf = np.zeros(len(first), dtype=np.uint8)  # writable: the socket writes the next message here
        buf[:] = np.frombuffer(first, dtype=np.uint8)
        got = c.get(buf, copy=True)
        assert got.dtype == torch.uint8 and got.shape == (4096,) and int(got[0]) == 7
        c.ack(buf)
        buf[:] = np.frombuffer(second, dtype=np.uint8)
        got = c.get(buf, copy=True)
        assert got.dtype == torch.int16 and got.shape == (2048,), "the previous message's fields were used"
        assert torch.equal(got, torch.arange(2048, dtype=torch.int16))
        c.ack(buf)

        # Read-only when parsed (so remembered), then made writable again and refilled.
        held = np.frombuffer(bytearray(first), dtype=np.uint8)
        held.flags.writeable = False
        assert c.get(held, copy=True).dtype == torch.uint8
        c.ack(held)
        held.flags.writeable = True
        held[:] = np.frombuffer(second, dtype=np.uint8)
        assert c.get(held, copy=True).dtype == torch.int16, "a buffer made writable again kept its old parse"
        c.ack(held)


def test_a_read_only_buffer_is_still_parsed_once_for_get_and_ack(daemon) -> None:
    """The identity cache still serves what cannot change through the object passed (bytes, a read-only
    buffer such as a zmq Frame): get(blob) then ack(blob) parse once."""
    with daemon.client(inline_threshold=BIG) as c:
        blob = np.frombuffer(c.put(torch.full((4096,), 3, dtype=torch.uint8)).to_bytes(), dtype=np.uint8)
        assert not blob.flags.writeable
        before = descriptor.parse_stats()
        assert int(c.get(blob)[0]) == 3
        c.ack(blob)
        after = descriptor.parse_stats()
        assert after["parses"] - before["parses"] == 1 and after["cache_hits"] - before["cache_hits"] == 1


def test_a_small_view_of_a_large_buffer_is_not_kept_alive_by_the_parse_cache(daemon) -> None:
    """A descriptor received as a view into a larger buffer (a batch of messages) is parsed without the
    inline cache holding that whole buffer past its bound: once the consumer drops its tensors and the
    view, the buffer goes."""
    with daemon.client(inline_threshold=BIG) as c:
        blob = c.put(torch.full((4096,), 5, dtype=torch.uint8)).to_bytes()
        batch = np.zeros(descriptor.INLINE_CACHE_MAX_BYTES * 2, dtype=np.uint8)  # larger than the cache's bound
        batch[: len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        batch.flags.writeable = False  # as received: read-only, so the identity cache may serve it
        gone = weakref.ref(batch)
        view = memoryview(batch)[: len(blob)]
        got = c.get(view, copy=True)
        assert int(got[0]) == 5
        c.ack(view)
        del view, batch
        gc.collect()
        assert gone() is None, "the parse cache keeps a buffer larger than its whole bound alive"


def test_a_hand_built_descriptor_writes_the_fields_it_holds() -> None:
    """to_bytes writes what a descriptor holds now, not the bytes cached for an equal-looking one before:
    a list of specs changed after a first to_bytes, and head fields of other types but equal values."""
    spec = TensorSpec("uint8", (256,), (1,), 0)
    base = Descriptor(kind="host", tensors=(spec,), nbytes=512, node="n", endpoint="e", pool=1, epoch=2, lease=3,
                      gen=4, token=b"t" * 16, offset=256)
    assert base.to_bytes() == _packb(base)

    specs = [spec]
    listed = dataclasses.replace(base, tensors=specs)  # type: ignore[arg-type]
    assert listed.to_bytes() == _packb(listed)
    specs.append(TensorSpec("uint8", (256,), (1,), 256))
    assert listed.to_bytes() == _packb(listed), "a changed list of specs was written as before"

    shape = [256]
    mutable = dataclasses.replace(base, tensors=(TensorSpec("uint8", shape, (1,), 0),))  # type: ignore[arg-type]
    assert mutable.to_bytes() == _packb(mutable)
    shape[0] = 512
    assert mutable.to_bytes() == _packb(mutable), "a changed shape list was written as before"

    for kind_a, kind_b in ((1, True), (1.0, 1)):  # equal as dict keys, not as msgpack bytes
        a = dataclasses.replace(base, kind=kind_a)  # type: ignore[arg-type]
        b = dataclasses.replace(base, kind=kind_b)  # type: ignore[arg-type]
        assert a.to_bytes() == _packb(a) and b.to_bytes() == _packb(b), "a head cached for an equal key"
        node_b = dataclasses.replace(base, node=kind_b)  # type: ignore[arg-type]
        assert dataclasses.replace(base, node=kind_a).to_bytes() == _packb(dataclasses.replace(base, node=kind_a))
        assert node_b.to_bytes() == _packb(node_b)
