"""Inline descriptors: the bytes msgpack makes, written with one copy of the payload and read as a view
into the received bytes, which the tensor keeps alive; get(blob) then ack(blob) parses once."""

from __future__ import annotations

import ctypes
import gc
import mmap
import random
import sys
import threading
from typing import Any, Iterator

import msgpack
import pytest
import torch

from mmfeat.client import tensors as tz
from mmfeat.client.produce import packing
from mmfeat.protos import Descriptor, DescriptorError
from mmfeat.protos import descriptor

BIG = 1 << 62  # an inline_threshold no feature reaches: every put goes inline


def _all_dtypes() -> list[torch.dtype]:
    return list(tz._TO_TORCH.values())


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    flat = raw.view(dtype)[: torch.Size(shape).numel()]
    return flat.reshape(shape)


def _legacy_bytes(desc: Descriptor, payload: bytes, pad: bool = True) -> bytes:
    """What msgpack.packb makes of the whole 15-element array: the format every reader knows. With
    ``pad``, its token is the zero bytes that start the payload at a multiple of 64 (SPEC "Descriptor")."""
    def packed(token: bytes) -> bytes:
        return msgpack.packb([1, "inline", "", "", -1, 0, 0, 0, 0, token, 0, desc.nbytes, desc.many,
                              [t.to_wire() for t in desc.tensors], payload], use_bin_type=True)

    bare = packed(b"")
    return packed(bytes(-(len(bare) - len(payload)) % 64)) if pad else bare


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise: NaNs in random float bytes compare unequal to themselves.
    return a.dtype == b.dtype and a.shape == b.shape and _bytes_of(a) == _bytes_of(b)


def _address_range(blob: bytes) -> tuple[int, int]:
    start = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value
    return start, start + len(blob)


@pytest.mark.parametrize("dtype", _all_dtypes(), ids=str)
def test_every_dtype_round_trips_inline_in_the_format_msgpack_makes(daemon, dtype) -> None:
    with daemon.client(inline_threshold=BIG) as c:
        cases = [_tensor(dtype, (3, 5), 1), _tensor(dtype, (), 2), _tensor(dtype, (0, 4), 3),
                 _tensor(dtype, (6, 4), 4).t(),  # non-contiguous
                 _tensor(dtype, (4, 6), 5)[:, ::2]]
        if dtype.is_complex:
            cases.append(_tensor(dtype, (5,), 10).conj())  # a lazy conjugate bit: its bytes are not the tensor's
        if dtype.is_floating_point and dtype.itemsize >= 2:
            cases.append(_tensor(dtype, (5,), 11).requires_grad_())
        for t in cases:
            desc = c.put(t)
            blob = desc.to_bytes()
            assert desc.is_inline and blob == _legacy_bytes(desc, _bytes_of(t))
            assert (len(blob) - desc.nbytes) % 64 == 0  # the payload starts aligned in the descriptor
            got = c.get(blob)
            assert _same(got, t) and got.is_contiguous() and got.data_ptr() % 64 == 0
            private = c.get(blob, copy=True)
            assert _same(private, t) and private.data_ptr() % 64 == 0
            old = _legacy_bytes(desc, _bytes_of(t), pad=False)  # an older producer's: no padding
            assert Descriptor.from_bytes(old) == desc and _same(c.get(old), t) and c.get(old).data_ptr() % 64 == 0
            c.ack(blob)
        # put_many: mixed with an empty tensor and padding between and after
        many = [_tensor(dtype, (7,), 6), _tensor(dtype, (0,), 7), _tensor(dtype, (2, 3), 8).t(),
                _tensor(dtype, (0,), 9)]
        desc = c.put_many(many)
        blob = desc.to_bytes()
        assert len(desc.inline) == desc.nbytes and Descriptor.from_bytes(bytes(bytearray(blob))) == desc
        for got, t in zip(c.get(blob), many):
            assert _same(got, t) and got.data_ptr() % 64 == 0
        c.ack(blob)


def test_put_makes_the_bytes_once_and_get_views_them_where_they_are_aligned(daemon) -> None:
    """The payload starts 64-aligned from the descriptor's first byte: received into an aligned buffer
    it is viewed in place; received as bytes (whose data sits at an offset inside the object) it is
    copied once into aligned memory."""
    with daemon.client(inline_threshold=BIG) as c:
        t = torch.arange(16384, dtype=torch.float32)
        desc = c.put(t)
        blob = desc.to_bytes()
        assert desc.to_bytes() is blob  # made at put, not packed again per call
        lo, hi = _address_range(blob)
        view = torch.frombuffer(desc.inline, dtype=torch.uint8)
        assert lo <= view.data_ptr() and view.data_ptr() + desc.nbytes == hi  # the payload inside those bytes
        page = mmap.mmap(-1, len(blob))  # as an aligned receive buffer holds it: other bytes, same value
        page[:] = blob
        received = memoryview(page).toreadonly()
        got = c.get(received)
        lo = torch.frombuffer(page, dtype=torch.uint8).data_ptr()
        assert got.data_ptr() == lo + len(blob) - desc.nbytes, "get copied an aligned payload"
        assert torch.equal(got, t) and got.data_ptr() % 64 == 0
        private = c.get(received, copy=True)
        assert not lo <= private.data_ptr() < lo + len(blob) and private.data_ptr() % 64 == 0
        private += 1  # copy=True is writable and private
        assert torch.equal(c.get(received), t)
        c.ack(received)
        as_bytes = bytes(bytearray(blob))
        lo, hi = _address_range(as_bytes)
        got = c.get(as_bytes)
        assert torch.equal(got, t) and got.data_ptr() % 64 == 0
        assert (lo <= got.data_ptr() < hi) == ((lo + len(blob) - desc.nbytes) % 64 == 0)
        c.ack(as_bytes)


def test_the_tensor_keeps_the_received_bytes_alive(daemon) -> None:
    with daemon.client(inline_threshold=BIG) as c:
        t = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB: its bytes are their own mapping, unmapped when freed
        blob = bytes(bytearray(c.put(t).to_bytes()))
        got = c.get(blob)
        c.ack(blob)
        del blob
        for k in range(descriptor.INLINE_CACHE_ENTRIES + 1):  # push it out of the parse cache too
            c.get(bytes(bytearray(c.put(torch.full((4,), k)).to_bytes())))
        gc.collect()
        assert torch.equal(got, t)
        churn = [bytes(4 << 20) for _ in range(4)]  # would reuse freed memory if the view did not hold it
        assert torch.equal(got, t) and len(churn) == 4


def test_get_then_ack_of_the_same_bytes_parses_once(daemon) -> None:
    with daemon.client(inline_threshold=BIG) as inline, daemon.client(inline_threshold=0, fallback="error") as pool:
        for c, t in ((inline, torch.arange(65536 // 4, dtype=torch.float32)), (pool, torch.ones(1000))):
            blob = bytes(bytearray(c.put(t).to_bytes()))
            before = descriptor.parse_stats()
            c.get(blob)
            c.ack(blob)
            after = descriptor.parse_stats()
            assert after["parses"] - before["parses"] == 1, (c.inline_threshold, before, after)
            assert after["cache_hits"] - before["cache_hits"] == 1
        assert pool.flush(10)


def test_get_then_ack_of_a_tiny_inline_features_bytes_parses_once(daemon) -> None:
    """An inline descriptor short enough for the value-keyed cache (a few small tensors, such as an image's
    grid sizes) is found again by the identity of its bytes, like a long one; and each parse of the same
    bytes is counted once in the cache's byte total, which would otherwise grow until it evicted every
    entry at each new one."""
    with daemon.client(inline_threshold=BIG) as c:
        blob = bytes(bytearray(c.put(torch.arange(4, dtype=torch.int64)).to_bytes()))
        assert len(blob) <= descriptor.PARSE_CACHE_MAX_BYTES
        before = descriptor.parse_stats()
        assert c.get(blob).tolist() == [0, 1, 2, 3]
        c.ack(blob)
        after = descriptor.parse_stats()
        assert (after["parses"] - before["parses"], after["cache_hits"] - before["cache_hits"]) == (1, 1), after
        for _ in range(10):
            Descriptor.from_bytes(blob)
        held = sum(n for _, _, n in descriptor._inline_parsed.values())
        assert descriptor._inline_cached_bytes == held, (descriptor._inline_cached_bytes, held)


def test_the_inline_caches_byte_total_holds_when_threads_parse_at_once(daemon) -> None:
    """Consumer threads sharing a process parse inline descriptors at once: the cache's byte total, which
    bounds what the entries hold alive, must stay the sum of its entries. Unlocked, a thread switch inside
    ``+=`` or ``-=`` loses an update, and the total drifts for good (up, and each new entry evicts the
    rest; down, and the entries hold more than INLINE_CACHE_MAX_BYTES)."""
    with daemon.client(inline_threshold=BIG) as c:
        blobs = [c.put(torch.full((1 << 16,), k, dtype=torch.uint8)).to_bytes() for k in range(64)]
    errors: list[BaseException] = []

    def parse(i: int) -> None:
        try:
            for r in range(300):
                Descriptor.from_bytes(bytes(bytearray(blobs[(i * 7 + r) % 64])))  # a new object each time
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=parse, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors and not any(t.is_alive() for t in threads), errors
    held = sum(n for _, _, n in descriptor._inline_parsed.values())
    assert descriptor._inline_cached_bytes == held, (descriptor._inline_cached_bytes, held)


def test_the_inline_cache_is_bounded_by_entries_and_bytes(daemon) -> None:
    with daemon.client(inline_threshold=BIG) as c:
        blobs = [bytes(bytearray(c.put(torch.full((1 << 18,), k, dtype=torch.uint8)).to_bytes()))
                 for k in range(descriptor.INLINE_CACHE_ENTRIES * 2)]
        for b in blobs:
            c.get(b)
        assert len(descriptor._inline_parsed) <= descriptor.INLINE_CACHE_ENTRIES
        assert sum(n for _, _, n in descriptor._inline_parsed.values()) <= descriptor.INLINE_CACHE_MAX_BYTES


def test_mutated_inline_bytes_are_refused_as_the_full_parse_refuses_them() -> None:
    """bytes take the view path (or, from_bytes, a head already learned), a bytearray the full msgpack
    parse: all accept and refuse alike."""
    t = torch.arange(300, dtype=torch.int16)
    specs, nbytes = packing.layout([t])
    good = Descriptor.inline_of(tuple(specs), nbytes, False, packing.packed_parts([t], specs, nbytes)).to_bytes()
    rng = random.Random(7)
    blobs = [good[:n] for n in range(0, len(good), 7)] + [good + b"\0"]
    for _ in range(3000):
        b = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(b)) if rng.random() < 0.5 else rng.randrange(min(len(b), 200))
            b[at] = rng.randrange(256)
        blobs.append(bytes(b))
    for blob in blobs:
        try:
            fast = descriptor.parse_in_full(blob)
        except DescriptorError:
            fast = None
        try:
            full = descriptor.parse_in_full(bytearray(blob))
        except DescriptorError:
            full = None
        try:
            known = Descriptor.from_bytes(blob)  # its head may be one already learned: no decoding at all
        except DescriptorError:
            known = None
        try:
            viewed = Descriptor.from_bytes(memoryview(blob))  # a buffer: read in place
        except DescriptorError:
            viewed = None
        assert (fast is None) == (full is None) == (known is None) == (viewed is None), blob.hex()
        if fast is not None:
            assert fast == full == known == viewed
            assert bytes(fast.inline) == bytes(full.inline) == bytes(known.inline) == bytes(viewed.inline)
            assert len(fast.inline) == fast.nbytes
    assert len(descriptor._inline_heads) <= descriptor.INLINE_HEADS


@pytest.fixture
def push_pull(tmp_path) -> Iterator[tuple[Any, Any]]:
    """A ZeroMQ PUSH socket connected to a PULL socket over ipc, as a server hands descriptors on."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        pull.bind(f"ipc://{tmp_path}/feat.sock")
        push.connect(f"ipc://{tmp_path}/feat.sock")
        yield push, pull
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_a_small_zmq_frame_is_parsed_as_its_bytes_are(daemon, push_pull) -> None:
    """Frames of up to PARSE_CACHE_MAX_BYTES (every pool descriptor, and inline ones of tiny features) are
    parsed from the Frame's bytes: the same descriptor and tensor as the bytes give, once per Frame
    (get(frame) then ack(frame) parse once), and a mutated one is refused as the bytes are."""
    push, pull = push_pull
    with daemon.client(inline_threshold=0) as pool_producer, \
            daemon.client(inline_threshold=BIG) as inline_producer, daemon.client() as consumer:
        for producer, t in ((pool_producer, _tensor(torch.float32, (64, 64), 3)),
                            (inline_producer, _tensor(torch.int16, (5, 3), 4))):
            blob = producer.put(t).to_bytes()
            assert len(blob) <= descriptor.PARSE_CACHE_MAX_BYTES
            push.send(blob, copy=False)
            frame = pull.recv(copy=False)
            assert Descriptor.from_bytes(frame) == Descriptor.from_bytes(blob)
            before = descriptor.parse_stats()
            assert _same(consumer.get(frame), t)
            consumer.ack(frame)
            assert descriptor.parse_stats()["parses"] - before["parses"] <= 1
            bad = bytearray(blob)
            bad[1] ^= 0xFF
            push.send(bytes(bad), copy=False)
            with pytest.raises(DescriptorError):
                Descriptor.from_bytes(pull.recv(copy=False))


def test_a_zmq_frame_received_without_copying_is_read_in_place(daemon, push_pull) -> None:
    """A consumer that receives with copy=False hands get() the Frame: the tensor views the payload
    inside the message ZeroMQ received where it is aligned (else an aligned copy), keeps it alive, and
    ack(frame) parses nothing more."""
    push, pull = push_pull
    with daemon.client(inline_threshold=BIG) as producer, daemon.client() as consumer:
        t = _tensor(torch.float32, (128, 128), 11)
        push.send(producer.put(t).to_bytes(), copy=False)
        frame = pull.recv(copy=False)
        start = torch.frombuffer(frame.buffer, dtype=torch.uint8).data_ptr()
        before = descriptor.parse_stats()
        got = consumer.get(frame)
        consumer.ack(frame)
        after = descriptor.parse_stats()
        assert _same(got, t) and got.data_ptr() % 64 == 0
        payload = start + len(frame.buffer) - t.nbytes
        # Viewed in place where the message's payload is aligned, else copied once into aligned memory.
        assert (got.data_ptr() == payload) == (payload % 64 == 0)
        assert after["parses"] - before["parses"] == 1 and after["cache_hits"] - before["cache_hits"] == 1
        del frame
        descriptor._inline_parsed.clear()  # the cache's reference too: only the tensor holds the message
        gc.collect()
        churn = [bytes(1 << 16) for _ in range(64)]  # would reuse the message's memory if it were freed
        assert _same(got, t) and len(churn) == 64


def test_a_bytearray_is_copied_and_a_strided_buffer_refused(daemon) -> None:
    with daemon.client(inline_threshold=BIG) as c:
        t = _tensor(torch.int32, (64, 64), 12)
        raw = bytearray(c.put(t).to_bytes())
        got = c.get(raw)
        raw[-t.nbytes:] = bytes(t.nbytes)  # the caller writes its buffer again: the tensor is its own copy
        assert _same(got, t)
        with pytest.raises(Exception, match="contiguous"):
            Descriptor.from_bytes(memoryview(bytes(raw))[::2])
        with pytest.raises(TypeError, match="expected a Descriptor"):
            c.get("not bytes")


def test_a_producer_packs_each_layout_once_and_its_bytes_stay_what_msgpack_makes() -> None:
    """Heads are kept by layout, bounded; a layout seen again gives the bytes msgpack makes, whatever
    came between."""
    def made(t: torch.Tensor) -> bytes:
        specs, nbytes = packing.layout([t])
        return Descriptor.inline_of(tuple(specs), nbytes, False, packing.packed_parts([t], specs, nbytes)).to_bytes()

    a, b = _tensor(torch.float16, (7, 3), 20), _tensor(torch.int64, (5,), 21)
    for t in (a, b, a, b):
        desc = Descriptor.from_bytes(made(t))
        assert made(t) == _legacy_bytes(desc, _bytes_of(t))
    for n in range(descriptor.INLINE_HEADS + 10):
        made(torch.zeros(n + 1, dtype=torch.uint8))
    assert len(descriptor._inline_made) <= descriptor.INLINE_HEADS
    assert made(a) == _legacy_bytes(Descriptor.from_bytes(made(a)), _bytes_of(a))
