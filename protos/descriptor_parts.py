"""The repeated parts of pool descriptors' bytes, remembered once checked.

Every descriptor of one pool starts with the same bytes (format, kind, node, endpoint, device, pool,
epoch: the *head*), and every descriptor of one feature shape ends with the same bytes (nbytes, many,
the tensor specs, no inline data: the *tail*). Only the four fields between differ from feature to
feature: lease, generation, token and offset. A consumer parsing a new descriptor spent most of its
10 µs checking the head and tail again (dtype, shape against the lease, strides, alignment), and a
producer re-encoded them.

Here a head and a tail are remembered once a full parse has accepted them (or this process encoded
them from its own checked fields), as the exact bytes msgpack makes for them. A descriptor then parses
by comparing its ends with those bytes and decoding the four fields between, with the checks a full
parse makes on them; anything else (another encoding, a negative integer, a short or long token,
trailing bytes) is not recognised here and takes the full parse, which accepts or refuses it.
``test_descriptors`` checks that the two agree on mutated and random bytes.
"""

from __future__ import annotations

import struct
from typing import Any, Optional

import msgpack

LEASE_ALIGNMENT = 256  # as descriptor.LEASE_ALIGNMENT: every lease starts on this boundary
TOKEN_HEADER = b"\xc4\x10"  # msgpack bin 8 of 16 bytes: the token

_HEADS = 8  # pools one process reads from at once: a node's GPUs and its host pool
_TAILS = 1024  # feature shapes; past this the table starts again (a miss only costs a full parse)
_U16, _U32, _U64 = struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")
_ARRAY15 = b"\x9f"


class _Unknown(Exception):
    """Bytes this module does not recognise: the full parse decides."""


def _uint(data: bytes, at: int) -> tuple[int, int]:
    """A non-negative msgpack integer at ``at``: (value, the offset after it)."""
    kind = data[at]
    if kind < 0x80:
        return kind, at + 1
    if kind == 0xCC:
        return data[at + 1], at + 2
    if kind == 0xCD:
        return _U16.unpack_from(data, at + 1)[0], at + 3
    if kind == 0xCE:
        return _U32.unpack_from(data, at + 1)[0], at + 5
    if kind == 0xCF:
        return _U64.unpack_from(data, at + 1)[0], at + 9
    raise _Unknown


def head_bytes(fmt: int, kind: str, node: str, endpoint: str, device: int, pool: int, epoch: int) -> bytes:
    return _ARRAY15 + b"".join(msgpack.packb(v, use_bin_type=True) for v in (fmt, kind, node, endpoint, device, pool, epoch))


def tail_bytes(nbytes: int, many: bool, wire_tensors: list[Any]) -> bytes:
    return b"".join(msgpack.packb(v, use_bin_type=True) for v in (nbytes, many, wire_tensors, None))


class KnownParts:
    """Heads and tails already checked, and the fields they stand for."""

    def __init__(self) -> None:
        # Most recently used first; each (head bytes, (kind, node, endpoint, device, pool, epoch)).
        self._heads: list[tuple[bytes, tuple[str, str, str, int, int, int]]] = []
        self._tails: dict[bytes, tuple[int, bool, tuple[Any, ...]]] = {}  # tail -> (nbytes, many, specs)

    def __len__(self) -> int:
        return len(self._heads) + len(self._tails)

    def remember(self, data: bytes, head: bytes, head_fields: tuple[str, str, str, int, int, int], tail: bytes,
                 tail_fields: tuple[int, bool, tuple[Any, ...]]) -> None:
        """Remember a head and a tail whose fields are checked, if ``data`` (their descriptor) is made of
        exactly those bytes around its four fields: a parse then finds what the full parse would."""
        if not (data.startswith(head) and data.endswith(tail) and len(data) > len(head) + len(tail)):
            return
        heads = self._heads
        if not heads or heads[0][0] != head:
            self._heads = [(head, head_fields)] + [h for h in heads if h[0] != head][: _HEADS - 1]
        if tail not in self._tails:
            if len(self._tails) >= _TAILS:
                self._tails.clear()
            self._tails[tail] = tail_fields

    def parse(self, data: bytes) -> Optional[tuple[Any, ...]]:
        """The 14 fields of ``Descriptor.checked`` for a descriptor made of a known head and tail, with
        its four own fields checked as a full parse checks them; None if this is not such a descriptor."""
        for head, head_fields in self._heads:
            if data.startswith(head):
                break
        else:
            return None
        try:
            lease, at = _uint(data, len(head))
            gen, at = _uint(data, at)
            if data[at : at + 2] != TOKEN_HEADER:
                return None
            token = data[at + 2 : at + 18]
            offset, at = _uint(data, at + 18)
        except (_Unknown, IndexError, struct.error):
            return None
        tail = self._tails.get(data[at:])
        if tail is None or offset % LEASE_ALIGNMENT:
            return None
        kind, node, endpoint, device, pool, epoch = head_fields
        nbytes, many, specs = tail
        return (kind, specs, nbytes, many, node, endpoint, device, pool, epoch, lease, gen, token, offset, None)

    def clear(self) -> None:
        self._heads = []
        self._tails.clear()
