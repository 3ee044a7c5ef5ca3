"""The repeated parts of pool descriptors' bytes, remembered once checked.

Every descriptor of one pool starts with the same bytes (format, kind, node, endpoint, device, pool,
epoch: the *head*), and every descriptor of one feature shape ends with the same bytes (nbytes, many,
the tensor specs, no inline data: the *tail*). Only the four fields between differ from feature to
feature: lease, generation, token and offset. A full parse of each new descriptor would spend most of
its time checking the head and tail again (dtype, shape against the lease, strides, alignment).

Here a head is remembered once a full parse has accepted it, as the bytes msgpack makes for its
fields, and a tail once it was checked, as the bytes it came in. A descriptor that starts with a known
head has its four fields decoded here (``split``) and checked by the caller; its tail is then either
known (a dict lookup) or parsed and checked alone. Anything else (another encoding, a negative integer,
a token of another size) takes the full parse. ``test_descriptors`` checks that the paths agree on
valid, mutated and re-encoded bytes.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Optional

import msgpack

TOKEN_HEADER = b"\xc4\x10"  # msgpack bin 8 of 16 bytes: the token

_HEADS = 8  # pools one process reads from at once: a node's GPUs and its host pool
_TAILS = 1024  # feature shapes; past this the table starts again (a miss only costs a full parse)
_U16, _U32, _U64 = struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")
_ARRAY15 = b"\x9f"


# msgpack's unsigned integer forms past a positive fixint: type byte -> (its big-endian value, the length)
_UINTS = {0xCC: (struct.Struct(">B"), 2), 0xCD: (_U16, 3), 0xCE: (_U32, 5), 0xCF: (_U64, 9)}


def head_bytes(fmt: int, kind: str, node: str, endpoint: str, device: int, pool: int, epoch: int) -> bytes:
    """msgpack's bytes for a descriptor's array header and its first seven fields."""
    return _ARRAY15 + b"".join(msgpack.packb(v, use_bin_type=True)
                               for v in (fmt, kind, node, endpoint, device, pool, epoch))


Head = tuple[str, str, str, int, int, int]  # kind, node, endpoint, device, pool, epoch
Tail = tuple[int, bool, tuple[Any, ...]]  # nbytes, many, the checked tensor specs


def head_fields(kind: str, node: str, endpoint: str, device: int, pool: int, epoch: int) -> dict[str, Any]:
    """A pool descriptor's head as the fields it sets (no inline data), for ``Descriptor.of_pool``."""
    return {"kind": kind, "node": node, "endpoint": endpoint, "device": device, "pool": pool, "epoch": epoch,
            "inline": None}


class KnownParts:
    """Heads and tails already checked, and the fields they stand for."""

    def __init__(self) -> None:
        self._heads: list[tuple[bytes, dict[str, Any]]] = []  # most recently learned first; at most _HEADS
        self._tails: dict[bytes, Tail] = {}

    def remember_head(self, data: bytes, head: bytes, fields: dict[str, Any]) -> None:
        """Remember a head whose fields a full parse of ``data`` accepted, if ``data`` starts with it."""
        if data.startswith(head):
            self._heads = [(head, fields)] + [h for h in self._heads if h[0] != head][: _HEADS - 1]

    def remember_tail(self, tail: bytes, fields: Tail) -> None:
        """Remember the bytes after a known head's four fields in a descriptor whose tail was checked,
        as they are (they were read as exactly nbytes, many, tensors and no inline data)."""
        if tail not in self._tails:
            if len(self._tails) >= _TAILS:
                self._tails.clear()
            self._tails[tail] = fields

    def tail(self, tail: bytes) -> Optional[Tail]:
        return self._tails.get(tail)

    def split(self, data: bytes) -> Optional[tuple[dict[str, Any], int, int, bytes, int, int]]:
        """For bytes that start with a known head and go on with three unsigned integers and a 16-byte
        token around the third (lease, generation, token, offset): the head's fields (``head_fields``,
        shared: not to be changed), those four, and where the tail starts. None for anything else. The
        offset's alignment and the tail are the caller's to check."""
        for head, fields in self._heads:
            if data.startswith(head):
                break
        else:
            return None
        # Three unsigned integers, each a positive fixint or one of _UINTS's forms (any other type byte:
        # KeyError), decoded inline: a consumer splits every descriptor it is sent.
        at = len(head)
        try:
            lease = data[at]
            if lease < 0x80:
                at += 1
            else:
                form = _UINTS[lease]
                lease, at = form[0].unpack_from(data, at + 1)[0], at + form[1]
            gen = data[at]
            if gen < 0x80:
                at += 1
            else:
                form = _UINTS[gen]
                gen, at = form[0].unpack_from(data, at + 1)[0], at + form[1]
            if data[at : at + 2] != TOKEN_HEADER:
                return None
            token = data[at + 2 : at + 18]
            at += 18
            offset = data[at]
            if offset < 0x80:
                at += 1
            else:
                form = _UINTS[offset]
                offset, at = form[0].unpack_from(data, at + 1)[0], at + form[1]
        except (KeyError, IndexError, struct.error):
            return None
        return fields, lease, gen, token, offset, at


class Encoder:
    """A pool descriptor's bytes from the parts of it a process has encoded before: its head's bytes (by
    its six fields) and its tail's (by the very tuple of tensor specs, which a producer's layout cache and
    a parse's known tails hand out again), joined around its four own fields. The same bytes msgpack
    makes for the whole array: it encodes each element on its own, after a one-byte array header."""

    def __init__(self) -> None:
        self._heads: dict[Head, bytes] = {}
        # id of a tuple of specs -> (that tuple, nbytes, many, the tail's bytes); an entry holds its tuple,
        # so the id cannot be another tuple's while the entry is there.
        self._tails: dict[int, tuple[tuple[Any, ...], int, bool, bytes]] = {}

    def encode(self, head: Head, lease: int, gen: int, token: bytes, offset: int, nbytes: int, many: bool,
               tensors: tuple[Any, ...]) -> bytes:
        head_wire = self._heads.get(head)
        if head_wire is None:
            if len(self._heads) >= _HEADS:
                self._heads.clear()
            head_wire = self._heads[head] = head_bytes(1, *head)
        tail = self._tails.get(id(tensors))
        if tail is not None and tail[0] is tensors and tail[1] == nbytes and tail[2] is many:
            tail_wire = tail[3]
        else:
            tail_wire = msgpack.packb([nbytes, many, [t.to_wire() for t in tensors], None], use_bin_type=True)[1:]
            # Kept by the tuple's identity only if nothing in it can change: a spec built by hand with a
            # list for its shape, changed in place, would otherwise keep the bytes of what it was.
            if _frozen(tensors):
                if len(self._tails) >= _TAILS:
                    self._tails.clear()
                self._tails[id(tensors)] = (tensors, nbytes, many, tail_wire)
        try:
            packer = _packers.packer
        except AttributeError:
            packer = _packers.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        middle = packer.pack([lease, gen, token, offset])  # its first byte is the fixarray header
        return b"".join((head_wire, middle[1:], tail_wire))


def _frozen(tensors: tuple[Any, ...]) -> bool:
    """Whether every spec's wire fields are immutable values (str, int and tuples of ints)."""
    for t in tensors:
        if (type(t.dtype) is not str or type(t.offset) is not int or type(t.shape) is not tuple
                or type(t.strides) is not tuple or any(type(v) is not int for v in (*t.shape, *t.strides))):
            return False
    return True


# One Packer per thread (a Packer is not thread-safe): packb makes a Packer per call, which costs three
# times the packing of the four fields.
_packers = threading.local()
