"""Corrupted and forged descriptors: refused with a typed error, never read outside the lease they name."""

from __future__ import annotations

import random
import struct
from dataclasses import replace

import msgpack
import pytest
import torch

from mmfeat.protos import Descriptor, DescriptorError, ErrorCode, MmfeatError, TensorSpec


def _spec_bytes(dtype="float32", shape=(4,), strides=(1,), offset=0, nbytes=256, lease_offset=0) -> bytes:
    d = Descriptor(kind="host", tensors=(TensorSpec(dtype, shape, strides, offset),), nbytes=nbytes,
                   token=b"t" * 16, offset=lease_offset)
    return d.to_bytes()


def _mutate_raw(blob: bytes, path: tuple, value) -> bytes:
    raw = msgpack.unpackb(blob, raw=False)
    target = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return msgpack.packb(raw, use_bin_type=True)


@pytest.mark.parametrize(
    "blob,why",
    [
        (_mutate_raw(_spec_bytes(), (13, 0, 0), ["float32"]), "unknown dtype"),
        (_mutate_raw(_spec_bytes(), (13, 0, 0), {"x": 1}), "unknown dtype"),
        (_mutate_raw(_spec_bytes(), (1,), ["host"]), "unknown descriptor kind"),
        (_spec_bytes(lease_offset=100), "256-byte aligned"),
        (_spec_bytes(shape=(1 << 30, 1 << 30), strides=(0, 0)), "zero stride"),
        (_spec_bytes(shape=(4, 100), strides=(1, 0)), "zero stride"),
        (_spec_bytes(shape=(65,), nbytes=256), "overruns"),
        (_spec_bytes(offset=2), "not aligned"),
        (_mutate_raw(_spec_bytes(), (11,), 0), "at least one byte"),
        (b"\x9f", "not a descriptor"),
        ("a str, not bytes", "a descriptor is bytes"),
    ],
)
def test_malformed_descriptors_raise_descriptor_error(blob, why) -> None:
    with pytest.raises(DescriptorError, match=why):
        Descriptor.from_bytes(blob)


def test_get_refuses_a_live_lease_named_with_another_range(daemon) -> None:
    with daemon.client(inline_threshold=0) as producer, daemon.client() as consumer:
        victim = producer.put(torch.arange(2048, dtype=torch.float32))
        d = producer.put(torch.arange(2048, dtype=torch.float32))
        # The same live lease id and generation, but the range of the victim next to it: the table
        # check must look at the range, not only the generation.
        for forged in (replace(d, offset=victim.offset), replace(d, nbytes=d.nbytes - 256),
                       replace(d, offset=d.offset + 256, nbytes=d.nbytes - 256)):
            with pytest.raises(MmfeatError) as info:
                consumer.get(forged)
            assert info.value.code is ErrorCode.FORBIDDEN
        assert torch.equal(consumer.get(d), torch.arange(2048, dtype=torch.float32))
        consumer.ack(d)
        consumer.ack(victim)
    assert daemon.pool()["used"] == 0


def _mutations(rng: random.Random, blob: bytes) -> bytes:
    """One random mutation of a valid descriptor: raw bytes, or one field of its msgpack structure."""
    choice = rng.random()
    if choice < 0.3:
        b = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.getrandbits(8)
        return bytes(b)
    if choice < 0.4:
        return blob[: rng.randrange(len(blob))]
    raw = msgpack.unpackb(blob, raw=False)
    values = [0, 1, -1, 255, 256, 257, 1 << 20, 1 << 40, 1 << 62, (1 << 64) - 1, 2.5, "x", "float32", b"", b"y" * 16,
              None, True, [], [1], {}, ["float32", [1], [1], 0]]
    if rng.random() < 0.5:
        raw[rng.randrange(len(raw))] = rng.choice(values)
    else:
        spec = raw[13][rng.randrange(len(raw[13]))]
        field = rng.randrange(4)
        if field in (1, 2) and spec[field] and rng.random() < 0.7:
            spec[field][rng.randrange(len(spec[field]))] = rng.choice([0, 1, 2, 7, 1 << 20, 1 << 40, -1])
        else:
            spec[field] = rng.choice(values)
    # Offsets and sizes near the real ones reach the table check instead of failing parsing.
    if rng.random() < 0.3 and type(raw[10]) is int and type(raw[11]) is int:
        raw[10] = max(0, raw[10] + rng.choice([-256, 256, 512, -512]))
        raw[11] = max(0, raw[11] + rng.choice([-256, 256, 0]))
    try:
        return msgpack.packb(raw, use_bin_type=True)
    except OverflowError:
        return blob


def test_parsed_descriptors_are_reused_only_for_the_same_bytes() -> None:
    from mmfeat.protos import descriptor

    good = _spec_bytes(nbytes=256)
    first = Descriptor.from_bytes(good)
    assert Descriptor.from_bytes(bytes(bytearray(good))) is first  # equal bytes: the validated result again
    bad = _mutate_raw(good, (11,), 8)  # same length, a lease too small for its tensor
    with pytest.raises(DescriptorError, match="overruns"):
        Descriptor.from_bytes(bad)
    with pytest.raises(DescriptorError, match="overruns"):
        Descriptor.from_bytes(bad)  # refusals are not remembered as anything else
    inline = Descriptor(kind="inline", tensors=(TensorSpec("uint8", (4,), (1,), 0),), nbytes=4,
                        inline=b"abcd").to_bytes()
    # Inline data is never kept by value (the descriptor views the bytes it was parsed from); the same
    # bytes object is found again by identity, as get then ack of it are.
    assert Descriptor.from_bytes(inline) is not Descriptor.from_bytes(bytes(bytearray(inline)))
    assert Descriptor.from_bytes(inline) is Descriptor.from_bytes(inline)
    for k in range(descriptor.PARSE_CACHE_ENTRIES + 10):  # bounded, however many distinct descriptors pass
        Descriptor.from_bytes(_spec_bytes(nbytes=256 + 256 * k))
    assert descriptor.parse_cache_len() <= descriptor.PARSE_CACHE_ENTRIES


def test_ten_thousand_mutated_descriptors(daemon) -> None:
    rng = random.Random(20261130)
    with daemon.client(inline_threshold=0) as producer, daemon.client(timeout=5.0) as consumer:
        originals = [
            producer.put(torch.arange(1000 + 64 * k, dtype=torch.float32)) for k in range(4)
        ] + [producer.put_many([torch.ones(300, dtype=torch.int16), torch.zeros(5, 7, dtype=torch.float64)])]
        by_lease = {(d.lease, d.gen): d for d in originals}
        session = consumer.session
        base = session.mapping(0).tensor.data_ptr()
        parsed = served = refused = 0
        for i in range(10_000):
            blob = _mutations(rng, rng.choice(originals).to_bytes())
            try:
                desc = Descriptor.from_bytes(blob)
            except DescriptorError:
                continue
            parsed += 1
            if desc.is_inline:
                continue
            try:
                got = consumer.get(desc, copy=(i % 7 == 0))
            except MmfeatError as exc:
                assert exc.code is not None and exc.code is not ErrorCode.INTERNAL
                refused += 1
                continue
            served += 1
            # Served: the descriptor named a live lease exactly, so every view lies inside it.
            real = by_lease[(desc.lease, desc.gen)]
            assert (desc.pool, desc.offset, desc.nbytes) == (real.pool, real.offset, real.nbytes)
            for t in got if isinstance(got, list) else [got]:
                if t.numel() and t.device.type == "cpu" and t.untyped_storage().data_ptr() != 0 and i % 7:
                    lo = t.data_ptr() - base
                    assert real.offset <= lo and lo + t.numel() * t.element_size() <= real.offset + real.nbytes
        assert parsed > 1000 and refused > 100 and served > 10, (parsed, refused, served)
        for d in originals:
            consumer.ack(d)
    s = daemon.stats()
    assert s["pools"][0]["used"] == 0 and s["counters"]["frees"] == len(originals)


def test_checked_descriptors_are_the_constructors_and_stay_frozen() -> None:
    """``Descriptor.checked`` skips the frozen dataclass's per-field setattr for speed: it must give the
    very object the constructor does, with every field, and stay immutable."""
    import dataclasses

    values = {f.name: i for i, f in enumerate(dataclasses.fields(Descriptor))}
    made = Descriptor.checked(**values)
    assert made == Descriptor(**values) and vars(made) == vars(Descriptor(**values))
    assert made.lease_ref() == Descriptor(**values).lease_ref()
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.offset = 0  # type: ignore[misc]
    with pytest.raises(TypeError):  # by name only: fourteen positional fields are too easy to swap
        Descriptor.checked(*values.values())  # type: ignore[misc]
    parsed = Descriptor.from_bytes(_spec_bytes(nbytes=256))
    assert Descriptor.from_bytes(parsed.to_bytes()) == parsed and type(parsed) is Descriptor


def test_known_parts_accept_only_what_a_full_parse_accepts_and_give_the_same_descriptor() -> None:
    """from_bytes checks a descriptor whose head and tail it has fully parsed before by comparing bytes
    and decoding the four fields between (protos/descriptor_parts.py). It must accept nothing the full
    parse refuses, give the very descriptor it gives, and recognise every valid descriptor of known parts."""
    from mmfeat.protos import descriptor

    rng = random.Random(20261201)
    specs = [
        (TensorSpec("uint8", (65536,), (1,), 0),),
        (TensorSpec("float32", (3, 224, 224), (50176, 224, 1), 0),),
        (TensorSpec("bfloat16", (16, 8), (8, 1), 0), TensorSpec("int64", (5,), (1,), 256)),
    ]
    templates = [
        Descriptor(kind=kind, tensors=t, nbytes=max(s.offset + s.extent for s in t) + 256 * extra,
                   many=len(t) > 1 or many,
                   node="node-a", endpoint="ipc:///run/mmfeat/mmfeatd.sock", device=device, pool=pool, epoch=epoch,
                   token=b"t" * 16)
        for kind, device, pool in (("host", -1, 0), ("cuda", 3, 2))
        for t in specs for extra in (0, 1) for many in (False, True)
        for epoch in (1, (1 << 63) + 5)
    ]
    for t in templates:  # a full parse of each makes its head and tail known
        assert descriptor.parse_in_full(t.to_bytes()) == t
        Descriptor.from_bytes(t.to_bytes())
    # Every width msgpack gives an unsigned integer, and the edges between them.
    ints = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, 1 << 62, (1 << 64) - 1]
    offsets = [0, 256, 65536, 1 << 32, 1 << 62, (1 << 64) - 256]
    recognised = refused_both = 0
    for i in range(30_000):
        d = replace(rng.choice(templates), lease=rng.choice(ints), gen=rng.choice(ints), offset=rng.choice(offsets),
                    token=rng.randbytes(16))
        blob = d.to_bytes()
        if i % 3 == 1 and i % 2:
            blob = _mutations(rng, blob)
        elif i % 3 == 1:  # the known head and four fields, then anything at all
            blob = blob[: rng.randrange(len(blob) - 40, len(blob))] + rng.randbytes(rng.randrange(40))
        elif i % 3 == 2:
            blob = _reencoded_fields(rng, d)
        try:
            full = descriptor.parse_in_full(blob)
        except DescriptorError:
            full = None
        known = descriptor.parse_known(blob)  # None unless its head and tail are known already
        try:
            parsed = Descriptor.from_bytes(blob)  # a known head: the four fields, then a known or new tail
        except DescriptorError:
            parsed = None
        if i % 3 == 0:  # valid: from_bytes has made its head and tail known, if they were not
            assert descriptor.parse_known(blob) == full == d, blob.hex()
        assert (parsed is None) == (full is None), blob.hex()
        if full is not None:
            assert vars(parsed) == vars(full), blob.hex()
        if known is not None:
            recognised += 1
            assert full is not None and vars(known) == vars(full), blob.hex()
        elif full is None:
            refused_both += 1
    assert recognised > 10_500 and refused_both > 10_000, (recognised, refused_both)


def _reencoded_fields(rng: random.Random, d: Descriptor) -> bytes:
    """``d``'s bytes with its lease, generation and offset each written in some msgpack form: the
    shortest, a wider unsigned one, a signed one (of the value or of a negative one), a float, nil."""
    def some_form(value: int) -> bytes:
        form = rng.randrange(6)
        if form == 0:
            return msgpack.packb(value)
        if form == 1:
            for code, fmt in ((0xCC, ">B"), (0xCD, ">H"), (0xCE, ">I"), (0xCF, ">Q")):
                if value < 1 << (8 * struct.calcsize(fmt)) and rng.random() < 0.5:
                    return bytes((code,)) + struct.pack(fmt, value)
            return b"\xcf" + struct.pack(">Q", value)
        if form == 2:
            signed = rng.choice([value, -value - 1, -1, -32, -33, -(1 << 31), -(1 << 63)])
            for code, fmt in ((0xD0, ">b"), (0xD1, ">h"), (0xD2, ">i"), (0xD3, ">q")):
                try:
                    return bytes((code,)) + struct.pack(fmt, signed)
                except struct.error:
                    continue
            return msgpack.packb(value)
        if form == 3:
            return bytes((rng.randrange(0xE0, 0x100),))  # a negative fixint
        if form == 4:
            return b"\xcb" + struct.pack(">d", float(value))
        return b"\xc0"

    def items(*values) -> bytes:
        return b"".join(msgpack.packb(v, use_bin_type=True) for v in values)

    return (b"\x9f" + items(1, d.kind, d.node, d.endpoint, d.device, d.pool, d.epoch)
            + some_form(d.lease) + some_form(d.gen) + b"\xc4\x10" + d.token + some_form(d.offset)
            + items(d.nbytes, d.many, [t.to_wire() for t in d.tensors], None))


@pytest.mark.parametrize("middle,why", [
    (b"\xff", "non-negative"),  # a negative lease
    (b"\xcb" + bytes(8), "non-negative"),  # a float
    (b"\xc0", "non-negative"),  # nil
])
def test_a_forged_field_between_known_parts_takes_the_full_parse_and_is_refused(middle, why) -> None:
    from mmfeat.protos import descriptor

    good = Descriptor(kind="host", tensors=(TensorSpec("uint8", (512,), (1,), 0),), nbytes=512, node="n",
                      endpoint="ipc:///x", pool=0, epoch=7, lease=3, gen=9, token=b"k" * 16, offset=1024)
    blob = good.to_bytes()
    assert Descriptor.from_bytes(blob) == good and descriptor.parse_known(blob) == good
    head = blob[: blob.index(b"\x03\x09\xc4\x10")]  # ... epoch, then lease 3 and gen 9
    forged = head + middle + blob[len(head) + 1:]
    assert descriptor.parse_known(forged) is None
    with pytest.raises(DescriptorError, match=why):
        Descriptor.from_bytes(forged)
    # trailing, short, misaligned
    for bad in (blob + b"\xc0", blob[:-1], blob.replace(b"\xcd\x04\x00", b"\xcd\x04\x01")):
        assert descriptor.parse_known(bad) is None
        with pytest.raises(DescriptorError):
            Descriptor.from_bytes(bad)


@pytest.mark.parametrize("index,value", [
    (10, 100), (11, 0), (11, -256), (11, 2.5), (11, "x"), (12, 1), (12, None), (13, []), (13, "x"),
    (13, [["float32", [4], [1], 0]] * 2), (13, [["float32", [65], [1], 0]]), (13, [["float99", [4], [1], 0]]),
    (14, b"x"), (14, 0),
])
def test_a_fault_after_a_known_head_is_refused_as_the_full_parse_refuses_it(index, value) -> None:
    """Once a pool's head is known, from_bytes checks the rest of a descriptor on its own: each single
    fault there must be refused with the full parse's own words."""
    from mmfeat.protos import descriptor

    good = Descriptor(kind="host", tensors=(TensorSpec("float32", (4,), (1,), 0),), nbytes=256, node="faults",
                      endpoint="ipc:///y", pool=1, epoch=11, lease=5, gen=6, token=b"f" * 16, offset=512)
    assert Descriptor.from_bytes(good.to_bytes()) == good and descriptor.parse_known(good.to_bytes()) == good
    blob = _mutate_raw(good.to_bytes(), (index,), value)
    if index == 11 and value == 0:
        blob = _mutate_raw(blob, (13,), [["float32", [0], [1], 0]])  # no byte at all: only the nbytes check says no
    with pytest.raises(DescriptorError) as full:
        descriptor.parse_in_full(blob)
    with pytest.raises(DescriptorError) as after_head:
        Descriptor.from_bytes(blob)
    assert str(after_head.value) == str(full.value)


def test_to_bytes_is_msgpack_of_every_field_whatever_it_encoded_before() -> None:
    """A pool descriptor's bytes are joined from its head's and tail's bytes, kept from earlier descriptors
    (descriptor_parts.Encoder, keyed by the head's fields and by the very tuple of specs): they must be
    the bytes msgpack makes for all fifteen fields, also for the same tuple with another size or ``many``."""
    from mmfeat.protos.descriptor_parts import head_fields

    rng = random.Random(5)
    one = (TensorSpec("uint8", (4096,), (1,), 0),)
    two = (TensorSpec("bfloat16", (16, 8), (8, 1), 0), TensorSpec("int64", (5,), (1,), 256))
    ints = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1]
    for _ in range(3000):
        tensors = rng.choice((one, two))
        head = head_fields(rng.choice(("host", "cuda")), rng.choice(("", "node-a", "n" * 300)),
                           rng.choice(("ipc:///x", "tcp://10.0.0.1:5555")), rng.choice((-1, 0, 7, 300)),
                           rng.choice((0, 1, 200)), rng.choice(ints))
        d = Descriptor.of_pool(head, tensors=tensors, nbytes=4096 + 256 * rng.randrange(3), many=rng.random() < 0.5,
                               lease=rng.choice(ints), gen=rng.choice(ints), token=rng.randbytes(16),
                               offset=rng.choice(ints))
        fields = [1, d.kind, d.node, d.endpoint, d.device, d.pool, d.epoch, d.lease, d.gen, d.token, d.offset,
                  d.nbytes, d.many, [t.to_wire() for t in d.tensors], None]
        assert d.to_bytes() == msgpack.packb(fields, use_bin_type=True)
        assert d == Descriptor(**{k: v for k, v in vars(d).items()})
    # Values equal to an int already encoded, of another type: encoded as they are (and refused by a parse).
    d = Descriptor.of_pool(head_fields("host", "", "ipc:///x", 0, 0, 1), tensors=one, nbytes=4096, many=False,
                           lease=1, gen=1, token=b"t" * 16, offset=0)
    d.to_bytes()
    for odd in (dict(device=False), dict(pool=0.0), dict(epoch=True), dict(nbytes=4096.0)):
        blob = replace(d, **odd).to_bytes()
        assert blob != d.to_bytes()
        with pytest.raises(DescriptorError):
            Descriptor.from_bytes(blob)


def test_of_pool_makes_what_checked_makes() -> None:
    """``Descriptor.of_pool`` (a head's fields, then the seven that differ) is ``checked`` for a pool
    descriptor: the same fields, nothing more, and as frozen."""
    import dataclasses

    from mmfeat.protos.descriptor_parts import head_fields

    tensors = (TensorSpec("float32", (4,), (1,), 0),)
    made = Descriptor.of_pool(head_fields("cuda", "n", "e", 2, 3, 4), tensors=tensors, nbytes=256, many=True,
                              lease=5, gen=6, token=b"t" * 16, offset=512)
    checked = Descriptor.checked(kind="cuda", tensors=tensors, nbytes=256, many=True, node="n", endpoint="e",
                                 device=2, pool=3, epoch=4, lease=5, gen=6, token=b"t" * 16, offset=512, inline=None)
    assert vars(made) == vars(checked) and made == checked
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.offset = 0  # type: ignore[misc]
