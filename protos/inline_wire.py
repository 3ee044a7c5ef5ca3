"""An inline descriptor's bytes, made and read without a second copy of the payload.

An inline descriptor is the same 15-element msgpack array as any other (SPEC.md, "Descriptor"), its
last element a bin holding the feature's bytes. Packing the whole array with msgpack copies the payload
once more than needed, and unpacking it copies it again into a new bytes object. Here the fourteen
small fields are packed on their own and the bin's header is written by hand, so the payload is copied
exactly once, straight into the final bytes (``join``); reading decodes the fourteen fields alone and
hands back a read-only memoryview of the payload inside the received bytes. The bytes are the ones
``msgpack.packb`` makes for the same array, so either side may be the older code.

The payload starts at a multiple of PAYLOAD_ALIGNMENT from the descriptor's first byte: the token field
(index 9), which an inline descriptor has no use for, is a bin of zero bytes just long enough to push the
payload there. Any msgpack decoder reads that as it reads any bin, and readers ignore an inline token, so
a buffer that itself starts aligned (a page, a pool, an aligned receive buffer) holds an aligned payload.
"""

from __future__ import annotations

import struct
from typing import Any, Optional, Sequence

import msgpack

_ARRAY14, _ARRAY15 = 0x9E, 0x9F  # msgpack fixarray headers
_BIN8, _BIN16, _BIN32 = 0xC4, 0xC5, 0xC6
_U16, _U32 = struct.Struct(">H"), struct.Struct(">I")
_HEAD14 = bytes((_ARRAY14,))
_TOKEN = 9  # the field an inline descriptor pads with
# Where an inline payload starts, from the descriptor's first byte: torch's CPU allocator aligns this way,
# and views of any dtype (complex128's 16 bytes included) want at least their element size.
PAYLOAD_ALIGNMENT = 64
_FIRST_CHUNK = 1024  # the fourteen fields of one tensor are ~100-200 bytes; more is fed only when needed


def bin_header(n: int) -> bytes:
    """msgpack's header for a bin of ``n`` bytes: the smallest form, as msgpack.packb writes it."""
    if n < 1 << 8:
        return bytes((_BIN8, n))
    if n < 1 << 16:
        return bytes((_BIN16,)) + _U16.pack(n)
    if n < 1 << 32:
        return bytes((_BIN32,)) + _U32.pack(n)
    raise ValueError(f"an inline payload of {n} bytes is over msgpack's 4 GiB bin limit")


def head(fields: Sequence[Any], nbytes: int) -> bytes:
    """The descriptor's bytes before its payload: the first fourteen ``fields`` and the bin header of a
    payload of ``nbytes``, PAYLOAD_ALIGNMENT long or a multiple of it (the token, ``fields[9]``, is
    replaced by the zero bytes of padding that make it so)."""
    fields = list(fields)
    if len(fields) != 14:
        raise ValueError("an inline descriptor's head is its first fourteen fields")
    fields[_TOKEN] = b""
    bare = len(msgpack.packb(fields, use_bin_type=True)) + len(bin_header(nbytes))
    # A bin8 of under 256 bytes has the same 2-byte header however long: padding adds exactly its length.
    fields[_TOKEN] = bytes(-bare % PAYLOAD_ALIGNMENT)
    packed = bytearray(msgpack.packb(fields, use_bin_type=True))
    if packed[0] != _ARRAY14:
        raise ValueError("an inline descriptor's head is its first fourteen fields")
    packed[0] = _ARRAY15
    packed += bin_header(nbytes)
    return bytes(packed)


def encode(fields: Sequence[Any], parts: Sequence[Any], nbytes: int) -> tuple[bytes, int]:
    """The whole descriptor from its first fourteen ``fields`` and the payload as buffers ``parts``
    (``nbytes`` in all), copied once; and where the payload starts in it."""
    first = head(fields, nbytes)
    return b"".join([first, *parts]), len(first)


def decode(data: bytes, unpack_kwargs: dict[str, Any]) -> Optional[tuple[Any, memoryview]]:
    """The fourteen fields and a read-only view of the payload of bytes laid out as ``encode`` lays
    them out (what any msgpack packer makes of an inline descriptor); None for anything else, which the
    full parse then judges. Decoding errors propagate: the caller turns them into DescriptorError."""
    if len(data) < 2 or data[0] != _ARRAY15:
        return None
    unpacker = msgpack.Unpacker(**unpack_kwargs)
    # The same bytes read as a 14-element array: msgpack decodes the head in one call and stops there.
    unpacker.feed(_HEAD14)
    fed = min(len(data), _FIRST_CHUNK)
    unpacker.feed(data[1:fed])
    while True:
        try:
            fields = unpacker.unpack()
            break
        except msgpack.OutOfData:
            if fed >= len(data):
                return None
            more = min(len(data), fed * 4)
            unpacker.feed(data[fed:more])
            fed = more
    at = unpacker.tell()  # the stream read so far is data[:at], its first byte changed
    kind = data[at] if at < len(data) else None
    if kind == _BIN8 and at + 2 <= len(data):
        n, start = data[at + 1], at + 2
    elif kind == _BIN16 and at + 3 <= len(data):
        n, start = _U16.unpack_from(data, at + 1)[0], at + 3
    elif kind == _BIN32 and at + 5 <= len(data):
        n, start = _U32.unpack_from(data, at + 1)[0], at + 5
    else:
        return None
    if start + n != len(data):
        return None
    return fields, memoryview(data)[start:].toreadonly()
