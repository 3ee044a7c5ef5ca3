"""The descriptor: the small record that names a feature and travels in the server's own messages.

``to_bytes()`` gives a msgpack array (about 150-250 bytes for one tensor); ``from_bytes()`` validates
everything a consumer will later trust: known dtype, non-negative shape and strides that do not
overlap, aligned offsets, every tensor (its extent and its element count) inside the lease. It raises
DescriptorError and nothing else, whatever the bytes. SPEC.md, "Descriptor", gives the layout.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import msgpack

try:
    from zmq import Frame as _ZmqFrame
except ImportError:  # the wire format alone, without the client's transport
    _ZmqFrame = None

from . import inline_wire
from .descriptor_parts import Encoder, KnownParts, Tail, head_bytes, head_fields
from .messages import TOKEN_BYTES
from .tensor_spec import MAX_TENSORS as _MAX_TENSORS
from .tensor_spec import DescriptorError, TensorSpec
from .tensor_spec import tensor_specs as _tensor_specs

FORMAT = 1
POOL_KINDS = ("host", "cuda")  # where a pool's memory lives
HANDLE_KINDS = ("posix_fd", "fabric")  # how a process gains access to a pool
KINDS = (*POOL_KINDS, "inline")
_MAX_DESCRIPTOR_BYTES = 1 << 31
# Leases start on this boundary (the daemon's allocator aligns every range), so any dtype view is aligned.
LEASE_ALIGNMENT = 256


PARSE_CACHE_MAX_BYTES = 512
PARSE_CACHE_ENTRIES = 4096
_parsed: dict[bytes, "Descriptor"] = {}
_known = KnownParts()  # heads and tails already checked: a later descriptor checks only what differs
_encoder = Encoder()  # the same parts' bytes, for to_bytes
# Inline descriptors by the identity of the bytes they were parsed from: a consumer's ack(blob) after its
# get(blob) finds the parse there. Keyed by identity, not value: hashing a 64 KiB payload costs more
# than parsing its header. An entry holds its bytes alive, so entries and their bytes are both bounded.
INLINE_CACHE_ENTRIES = 32
INLINE_CACHE_MAX_BYTES = 16 << 20
_inline_parsed: "OrderedDict[int, tuple[Any, Descriptor, int]]" = OrderedDict()
_inline_cached_bytes = 0
# Over the entries and their byte total together: consumer threads parse at once, and a switch inside
# ``+=`` would lose an update, leaving the total wrong for good. Lookups need no lock.
_inline_lock = threading.Lock()


def _new_lock_in_child() -> None:
    # A thread of the parent remembering a parse at the fork holds the lock in the child for good.
    global _inline_lock
    _inline_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)
_counts = {"parses": 0, "cache_hits": 0}
# Inline descriptors' bytes before their payload (the fourteen fields and the bin header), once checked:
# a server sends a few feature shapes, and each new feature then differs from one of these only after them.
INLINE_HEADS = 1024
_INLINE_HEAD_LENGTHS = 8
_inline_heads: dict[bytes, "Descriptor"] = {}
# The same heads on the producer's side, by layout: each feature of a shape sent before joins a head
# packed once to its payload.
_inline_made: dict[tuple[Any, ...], tuple[bytes, "Descriptor"]] = {}
_inline_head_lengths: list[int] = []  # the distinct lengths of those heads, most recent first


def parse_stats() -> dict[str, int]:
    """How many times ``from_bytes`` parsed bytes (``parses``) and how many times it found them parsed
    already (``cache_hits``), in this process: a get(blob) then ack(blob) of one feature is one of each."""
    return dict(_counts)


def parse_cache_len() -> int:
    """How many parsed descriptors ``from_bytes`` keeps now (at most PARSE_CACHE_ENTRIES)."""
    return len(_parsed)


def parse_known(data: bytes) -> Optional["Descriptor"]:
    """The descriptor ``data`` names if it is made of a head and a tail already checked (see
    descriptor_parts.py), by the same code ``from_bytes`` runs for it; None otherwise (and for bytes
    that are not a descriptor). Learns nothing: for tests and triage."""
    split = _known.split(data) if type(data) is bytes else None
    if split is None or _known.tail(data[split[5]:]) is None:
        return None
    try:
        return Descriptor._parse_or_refuse(data, split)
    except DescriptorError:
        return None


def parse_in_full(data: bytes) -> "Descriptor":
    """The full parse, with neither cache: the reference ``from_bytes`` must agree with (tests, triage)."""
    return Descriptor._parse_or_refuse(data)


_INT_FIELDS = ("pool", "epoch", "lease", "gen", "offset", "nbytes")


_UNPACK_KWARGS: dict[str, Any] = dict(raw=False, max_bin_len=_MAX_DESCRIPTOR_BYTES, max_array_len=_MAX_TENSORS * 4,
                                      max_ext_len=0)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, **_UNPACK_KWARGS)
    except Exception as exc:
        raise DescriptorError(f"not a descriptor: {type(exc).__name__}: {exc}") from None


def _parse_pool_tail(tail: bytes) -> Tail:
    """A pool descriptor's last four fields (nbytes, many, tensors, inline), checked as a full parse
    checks them; ``tail`` must be exactly those four."""
    nbytes, many, tensors, inline = _unpack(b"\x94" + tail)  # msgpack: an array of the four
    if type(nbytes) is not int or nbytes < 0:
        raise DescriptorError("nbytes must be a non-negative integer")
    if type(many) is not bool:
        raise DescriptorError("node and endpoint must be strings, many a bool")
    if inline is not None:
        raise DescriptorError("a pool descriptor carries no inline data")
    if nbytes == 0:
        raise DescriptorError("a pool descriptor names at least one byte")
    return nbytes, many, _tensor_specs(tensors, many, nbytes)


@dataclass(frozen=True)
class Descriptor:
    """Names one feature: a lease in a pool (``kind`` host or cuda) or the bytes themselves (inline)."""

    kind: str
    tensors: tuple[TensorSpec, ...]
    nbytes: int
    many: bool = False
    node: str = ""
    endpoint: str = ""
    device: int = -1
    pool: int = 0
    epoch: int = 0
    lease: int = 0
    gen: int = 0
    # Out of repr: the token is what lets a holder of the descriptor ack the lease, and a repr ends up in logs.
    token: bytes = field(default=b"", repr=False)
    offset: int = 0
    # A read-only memoryview into the bytes the descriptor was made as or parsed from (no copy of its own).
    inline: Optional[Union[bytes, bytearray, memoryview]] = field(default=None, repr=False)

    @property
    def is_inline(self) -> bool:
        return self.kind == "inline"

    def lease_ref(self) -> dict[str, Any]:
        """The ``lease`` map that publish, ack, release and lookup requests carry."""
        return {
            "pool": self.pool,
            "epoch": self.epoch,
            "lease": self.lease,
            "gen": self.gen,
            "token": self.token,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    def to_bytes(self) -> bytes:
        wire = self.__dict__.get("_wire")  # an inline descriptor made by put is its bytes already
        if wire is not None:
            return wire
        if self.inline is not None:
            return inline_wire.encode(self._head_fields(), [self.inline], len(self.inline))[0]
        if (self.kind != "inline" and type(self.token) is bytes and len(self.token) == TOKEN_BYTES
                and type(self.device) is int and type(self.pool) is int and type(self.epoch) is int
                and type(self.nbytes) is int and type(self.kind) is str and type(self.node) is str
                and type(self.endpoint) is str and type(self.tensors) is tuple):
            # A pool descriptor, as every producer makes one per feature: the bytes of its head and tail
            # are made once (descriptor_parts.Encoder). A field of another type (1.0 or True where an int
            # or a str belongs: equal keys, other bytes) or a list of specs (changed in place, it would
            # keep the bytes cached by its identity) takes the whole packb, so its bytes stay what it holds.
            return _encoder.encode((self.kind, self.node, self.endpoint, self.device, self.pool, self.epoch),
                                   self.lease, self.gen, self.token, self.offset, self.nbytes, self.many,
                                   self.tensors)
        return msgpack.packb(
            [
                FORMAT,
                self.kind,
                self.node,
                self.endpoint,
                self.device,
                self.pool,
                self.epoch,
                self.lease,
                self.gen,
                self.token,
                self.offset,
                self.nbytes,
                self.many,
                [t.to_wire() for t in self.tensors],
                self.inline,
            ],
            use_bin_type=True,
        )

    def _head_fields(self) -> list[Any]:
        """The first fourteen wire fields, everything but the inline data."""
        return [FORMAT, self.kind, self.node, self.endpoint, self.device, self.pool, self.epoch, self.lease, self.gen,
                self.token, self.offset, self.nbytes, self.many, [t.to_wire() for t in self.tensors]]

    @classmethod
    def inline_of(cls, tensors: tuple[TensorSpec, ...], nbytes: int, many: bool,
                  parts: list[Any]) -> "Descriptor":
        """An inline descriptor whose payload is the buffers ``parts`` (``nbytes`` in all, already laid out
        as ``tensors`` say), copied once into the bytes ``to_bytes`` will return."""
        key = (tensors, nbytes, many)
        made = _inline_made.get(key)
        if made is None:
            template = cls.checked(kind="inline", tensors=tensors, nbytes=nbytes, many=many, node="", endpoint="",
                                   device=-1, pool=0, epoch=0, lease=0, gen=0, token=b"", offset=0, inline=None)
            if len(_inline_made) >= INLINE_HEADS:
                _inline_made.clear()  # a miss only costs packing a head
            made = _inline_made[key] = (inline_wire.head(template._head_fields(), nbytes), template)
        head, template = made
        wire = b"".join([head, *parts])
        desc = object.__new__(cls)
        desc.__dict__.update(template.__dict__, inline=memoryview(wire)[len(head):], _wire=wire)
        return desc

    @classmethod
    def from_bytes(cls, data: Union[bytes, bytearray, memoryview, Any]) -> "Descriptor":
        """The descriptor ``data`` holds: bytes, or any contiguous buffer, such as a memoryview or a zmq
        Frame received with ``copy=False``. An inline payload in a buffer is viewed where it lies, not
        copied (keep the buffer unchanged while its tensors are in use); a bytearray, made to be written
        again, is copied first. Only bytes, read-only buffers and zmq Frames are found again by identity:
        a writable buffer may hold the next feature by the time it comes back."""
        if type(data) is not bytes:
            return cls._from_buffer(data)
        # A consumer parses the same bytes for get() and again for ack(): the second time (and every
        # other rank of a node that hands the bytes around in-process) finds them here, already
        # validated. Keyed by the exact bytes of small pool descriptors only; a Descriptor is frozen.
        if len(data) > PARSE_CACHE_MAX_BYTES:
            return cls._inline_from_bytes(data, data)
        desc = _parsed.get(data)
        if desc is not None:
            _counts["cache_hits"] += 1
            return desc
        hit = _inline_parsed.get(id(data))  # a tiny inline one is kept by identity only, as a long one is
        if hit is not None and hit[0] is data:
            _counts["cache_hits"] += 1
            return hit[1]
        _counts["parses"] += 1
        split = _known.split(data)
        if split is not None:  # a pool this process has parsed a descriptor of before
            tail = _known.tail(data[split[5]:])
            if tail is not None and not split[4] % LEASE_ALIGNMENT:
                # Head and tail both checked before: _parse_after_head's result, without its frames.
                desc = cls.of_pool(split[0], tensors=tail[2], nbytes=tail[0], many=tail[1], lease=split[1],
                                   gen=split[2], token=split[3], offset=split[4])
            else:
                desc = cls._parse_or_refuse(data, split)
        else:
            desc = cls._parse_new(data)
            if desc.is_inline:
                _remember_inline(data, desc, len(data))
                return desc
            head = (desc.kind, desc.node, desc.endpoint, desc.device, desc.pool, desc.epoch)
            _known.remember_head(data, head_bytes(FORMAT, *head), head_fields(*head))
            split = _known.split(data)
            if split is not None:
                _known.remember_tail(data[split[5]:], (desc.nbytes, desc.many, desc.tensors))
        if len(_parsed) >= PARSE_CACHE_ENTRIES:
            _parsed.clear()  # cheaper than an LRU, and a miss only costs a parse
        _parsed[data] = desc
        return desc

    @classmethod
    def _from_buffer(cls, data: Any) -> "Descriptor":
        """``from_bytes`` of anything but bytes: small ones (every pool descriptor) as bytes, through the
        cache; larger ones read in place."""
        if type(data) is _ZmqFrame and len(data) <= PARSE_CACHE_MAX_BYTES:
            # A pool descriptor as a server receives it (copy=False, in case it is inline): the Frame's own
            # bytes cost a third of a memoryview's checks and tobytes, and the Frame keeps them, so its
            # ack finds the parse of its get (a tiny inline one by the identity of those bytes).
            return cls.from_bytes(data.bytes)
        hit = _inline_parsed.get(id(data))
        if hit is not None and hit[0] is data and _unchanging(data):
            _counts["cache_hits"] += 1
            return hit[1]
        buf = _buffer_of(data)
        if type(buf) is bytes:
            return cls.from_bytes(buf)
        return cls._inline_parse(buf, data)  # looked up above, where a writable buffer gets no answer

    @classmethod
    def _inline_from_bytes(cls, data: Union[bytes, memoryview], source: Any) -> "Descriptor":
        """``from_bytes`` of ``data`` too long for the value-keyed cache: most are inline descriptors, found
        again by the identity of ``source`` (what the caller passed) when it comes back (get, then ack)."""
        hit = _inline_parsed.get(id(source))
        if hit is not None and hit[0] is source:
            _counts["cache_hits"] += 1
            return hit[1]
        return cls._inline_parse(data, source)

    @classmethod
    def _inline_parse(cls, data: Union[bytes, memoryview], source: Any) -> "Descriptor":
        _counts["parses"] += 1
        desc = cls._parse_new(data)
        if desc.is_inline:
            _remember_inline(source, desc, len(data))
        return desc

    @classmethod
    def _parse_new(cls, data: bytes) -> "Descriptor":
        """The parse of bytes not seen before. An inline descriptor whose bytes before the payload match
        one already checked has the same fields (msgpack reads a prefix the same way whatever follows)
        and a payload of exactly its nbytes: it needs no decoding, only a view of its payload."""
        if type(data) is not bytes and type(data) is not memoryview:
            return cls._parse_or_refuse(data)
        for n in _inline_head_lengths:
            template = _inline_heads.get(bytes(data[:n]))
            if template is not None and len(data) - n == template.nbytes:
                desc = object.__new__(cls)
                desc.__dict__.update(template.__dict__, inline=memoryview(data)[n:].toreadonly())
                return desc
        desc = cls._parse_or_refuse(data)
        if desc.is_inline and isinstance(desc.inline, memoryview):  # the view path read it: a head to learn
            _learn_inline_head(bytes(data[: len(data) - desc.nbytes]), desc)
        return desc

    @classmethod
    def _parse_or_refuse(cls, data: bytes, split: Optional[tuple[Any, ...]] = None) -> "Descriptor":
        """The full parse, or with ``split`` (a known head) the parse of the rest; DescriptorError only."""
        try:
            return cls._parse(data) if split is None else cls._parse_after_head(data, split)
        except DescriptorError:
            raise
        except Exception as exc:  # any other failure on hostile bytes is still just a bad descriptor
            raise DescriptorError(f"not a descriptor: {type(exc).__name__}: {exc}") from None

    @classmethod
    def _parse_after_head(cls, data: bytes, split: tuple[Any, ...]) -> "Descriptor":
        """A descriptor whose head is known: its four fields are decoded (``split``); its tail is one
        already checked or is checked here alone, as ``_parse`` checks those fields of a pool descriptor."""
        head, lease, gen, token, offset, at = split
        tail_bytes = data[at:]
        tail = _known.tail(tail_bytes)
        if tail is None:
            tail = _parse_pool_tail(tail_bytes)
            _known.remember_tail(tail_bytes, tail)
        if offset % LEASE_ALIGNMENT:
            raise DescriptorError(f"lease offset {offset} is not {LEASE_ALIGNMENT}-byte aligned, as every lease is")
        return cls.of_pool(head, tensors=tail[2], nbytes=tail[0], many=tail[1], lease=lease, gen=gen, token=token,
                           offset=offset)

    @classmethod
    def _parse(cls, data: bytes) -> "Descriptor":
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DescriptorError(f"a descriptor is bytes, not {type(data).__name__}")
        # Bytes (immutable) or a read-only view of an inline descriptor: the payload stays where it is,
        # viewed, not copied.
        split = inline_wire.decode(data, _UNPACK_KWARGS) if type(data) in (bytes, memoryview) else None
        raw = [*split[0], split[1]] if split is not None else _unpack(data)
        if not isinstance(raw, list) or len(raw) != 15:
            raise DescriptorError("not a descriptor: expected a 15-element msgpack array")
        if raw[0] != FORMAT:
            raise DescriptorError(f"descriptor format {raw[0]!r} is not {FORMAT}; upgrade mmfeat")
        (_, kind, node, endpoint, device, pool, epoch, lease, gen, token, offset, nbytes, many, tensors, inline) = raw
        if not isinstance(kind, str) or kind not in KINDS:
            raise DescriptorError(f"unknown descriptor kind {kind!r}")
        if not isinstance(node, str) or not isinstance(endpoint, str) or type(many) is not bool:
            raise DescriptorError("node and endpoint must be strings, many a bool")
        ints = (pool, epoch, lease, gen, offset, nbytes)
        if not (type(pool) is type(epoch) is type(lease) is type(gen) is type(offset) is type(nbytes) is int
                and min(ints) >= 0):
            bad = next(i for i, v in enumerate(ints) if type(v) is not int or v < 0)
            raise DescriptorError(f"{_INT_FIELDS[bad]} must be a non-negative integer")
        if type(device) is not int or device < -1:
            raise DescriptorError("device must be an integer >= -1")
        if kind == "inline":
            if not isinstance(inline, (bytes, bytearray, memoryview)) or len(inline) != nbytes:
                raise DescriptorError("an inline descriptor must carry exactly nbytes of data")
            if not isinstance(token, bytes):
                raise DescriptorError("an inline descriptor's token (its padding) must be a bin")
            token = b""  # padding only (inline_wire.py): not part of what the descriptor names
        else:
            if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
                raise DescriptorError(f"a pool descriptor carries a {TOKEN_BYTES}-byte token")
            if inline is not None:
                raise DescriptorError("a pool descriptor carries no inline data")
            if offset % LEASE_ALIGNMENT:
                raise DescriptorError(f"lease offset {offset} is not {LEASE_ALIGNMENT}-byte aligned, as every lease is")
            if nbytes == 0:
                raise DescriptorError("a pool descriptor names at least one byte")
        return cls.checked(kind=kind, tensors=_tensor_specs(tensors, many, nbytes), nbytes=nbytes, many=many, node=node,
                           endpoint=endpoint, device=device, pool=pool, epoch=epoch, lease=lease, gen=gen, token=token,
                           offset=offset, inline=inline)

    @classmethod
    def checked(cls, *, kind: str, tensors: tuple[TensorSpec, ...], nbytes: int, many: bool, node: str,
                endpoint: str, device: int, pool: int, epoch: int, lease: int, gen: int, token: bytes, offset: int,
                inline: Optional[Union[bytes, bytearray, memoryview]]) -> "Descriptor":
        """The descriptor of fields that are already checked (a parse, or a producer's own placement),
        every field given, by name (fourteen in a row are too easy to swap). The same object the
        constructor makes, without its 14 ``object.__setattr__`` calls (frozen dataclasses set each field
        that way): a third of a parse's instructions, paid by every consumer and producer once per
        feature. ``test_descriptors`` keeps the two in step."""
        desc = object.__new__(cls)
        desc.__dict__.update(kind=kind, tensors=tensors, nbytes=nbytes, many=many, node=node, endpoint=endpoint,
                             device=device, pool=pool, epoch=epoch, lease=lease, gen=gen, token=token, offset=offset,
                             inline=inline)
        return desc

    @classmethod
    def of_pool(cls, head: dict[str, Any], *, tensors: tuple[TensorSpec, ...], nbytes: int, many: bool, lease: int,
                gen: int, token: bytes, offset: int) -> "Descriptor":
        """``checked`` for a pool descriptor whose kind, node, endpoint, device, pool and epoch are ``head``
        (``descriptor_parts.head_fields``, made once per pool): a producer's put and the parse of a known
        head make one per feature, and only these seven fields differ from one to the next."""
        desc = object.__new__(cls)
        fields = desc.__dict__
        fields.update(head)
        fields["tensors"] = tensors
        fields["nbytes"] = nbytes
        fields["many"] = many
        fields["lease"] = lease
        fields["gen"] = gen
        fields["token"] = token
        fields["offset"] = offset
        return desc

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # Pickle through the validated wire form, so a pickled descriptor is never more trusted than bytes.
        return (Descriptor.from_bytes, (self.to_bytes(),))


def _remember_inline(source: Any, desc: Descriptor, nbytes: int) -> None:
    """Keep ``desc``, parsed from ``source`` (``nbytes`` long), found again by identity; the entry holds
    ``source`` alive, so its id cannot be reused while it is there."""
    global _inline_cached_bytes
    if type(source) is not bytes:
        if not _unchanging(source):
            return  # a buffer written again (a receive buffer) holds the next feature under the same identity
        view = memoryview(source)
        if view.obj is not None and view.obj is not source:
            # A view holds its whole exporter alive (a batch it was cut from): the entry costs all of it.
            nbytes = max(nbytes, memoryview(view.obj).nbytes)
    if nbytes > INLINE_CACHE_MAX_BYTES:
        return  # its second parse reads the header alone: the payload is viewed, not copied
    with _inline_lock:
        again = _inline_parsed.pop(id(source), None)  # the same source parsed again: its bytes count once
        if again is not None:
            _inline_cached_bytes -= again[2]
        while _inline_parsed and (len(_inline_parsed) >= INLINE_CACHE_ENTRIES
                                  or _inline_cached_bytes + nbytes > INLINE_CACHE_MAX_BYTES):
            _inline_cached_bytes -= _inline_parsed.popitem(last=False)[1][2]
        _inline_parsed[id(source)] = (source, desc, nbytes)
        _inline_cached_bytes += nbytes


def _unchanging(source: Any) -> bool:
    """Whether ``source``'s bytes stay as they are while it lives, so its identity may stand for them: a
    read-only buffer, or a zmq Frame (writable by the buffer protocol, yet each receive makes a new one)."""
    return type(source) is _ZmqFrame or memoryview(source).readonly


def _buffer_of(data: Any) -> Union[bytes, memoryview]:
    """``data`` as bytes where it is a bytearray (written again by design) or small enough for the
    parse cache (every pool descriptor); otherwise a flat, read-only view of it."""
    if isinstance(data, bytearray):
        return bytes(data)
    try:
        view = memoryview(data)
    except TypeError:
        raise DescriptorError(f"a descriptor is bytes or a buffer, not {type(data).__name__}") from None
    if not view.c_contiguous:
        raise DescriptorError("a descriptor's buffer must be contiguous")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if view.nbytes <= PARSE_CACHE_MAX_BYTES:
        return view.tobytes()
    return view.toreadonly()


def _learn_inline_head(head: bytes, desc: Descriptor) -> None:
    if len(_inline_heads) >= INLINE_HEADS:
        _inline_heads.clear()  # a miss only costs a parse
        _inline_head_lengths.clear()
    _inline_heads[head] = desc.checked(kind=desc.kind, tensors=desc.tensors, nbytes=desc.nbytes, many=desc.many,
                                       node=desc.node, endpoint=desc.endpoint, device=desc.device, pool=desc.pool,
                                       epoch=desc.epoch, lease=desc.lease, gen=desc.gen, token=desc.token,
                                       offset=desc.offset, inline=None)
    if len(head) in _inline_head_lengths:
        _inline_head_lengths.remove(len(head))
    _inline_head_lengths.insert(0, len(head))
    del _inline_head_lengths[_INLINE_HEAD_LENGTHS:]
