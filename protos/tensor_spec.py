"""The tensors a descriptor names inside its lease, and the checks their wire form must pass (a spec
whose extent or element count leaves the lease is refused here, whatever the rest of the descriptor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .dtypes import DTYPE_SIZES

_MAX_DIMS = 16
MAX_TENSORS = 1024
_MAX_INT = 1 << 62  # shapes, strides and offsets: far past any real tensor, and products stay exact
# A tensor's offset in its lease or inline payload is a multiple of this (producers pack at 256), and
# leases and inline payloads start on it too: every view is aligned as torch's own allocator aligns.
TENSOR_ALIGNMENT = 64


class DescriptorError(ValueError):
    """Bytes that are not a valid descriptor."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor inside a lease: ``offset`` is in bytes from the lease start, strides in elements."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def extent(self) -> int:
        """Bytes from ``offset`` to one past the last element the tensor can touch."""
        last = 0
        for d, s in zip(self.shape, self.strides):
            if d == 0:
                return 0
            last += (d - 1) * s
        return (last + 1) * DTYPE_SIZES[self.dtype]

    def to_wire(self) -> list[Any]:
        return [self.dtype, list(self.shape), list(self.strides), self.offset]

    @classmethod
    def from_wire(cls, raw: Any) -> "TensorSpec":
        return spec_from_wire(raw, None)

    @classmethod
    def checked(cls, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> "TensorSpec":
        """The spec of fields that are already checked, without the frozen dataclass's four
        ``object.__setattr__`` calls (see ``Descriptor.checked``): producers make one per tensor they put."""
        spec = object.__new__(cls)
        spec.__dict__.update(dtype=dtype, shape=shape, strides=strides, offset=offset)
        return spec


def spec_from_wire(raw: Any, nbytes: Optional[int]) -> TensorSpec:
    """A tensor spec from its wire form, checked in one pass (consumers parse one per feature); with
    ``nbytes``, also checked to lie inside a lease of that size: its extent and its element count."""
    if not (isinstance(raw, list) and len(raw) == 4):
        raise DescriptorError("tensor spec must be [dtype, shape, strides, offset]")
    dtype, shape, strides, offset = raw
    itemsize = DTYPE_SIZES.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise DescriptorError(f"unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and isinstance(strides, list)) or len(shape) != len(strides):
        raise DescriptorError("shape and strides must be lists of the same length")
    if len(shape) > _MAX_DIMS:
        raise DescriptorError(f"more than {_MAX_DIMS} dimensions")
    if type(offset) is not int or not 0 <= offset <= _MAX_INT:
        raise DescriptorError("shape, strides and offset must be non-negative integers")
    numel, last = 1, 0
    for d, s in zip(shape, strides):
        if type(d) is not int or type(s) is not int or not 0 <= d <= _MAX_INT or not 0 <= s <= _MAX_INT:
            raise DescriptorError("shape, strides and offset must be non-negative integers")
        if s == 0 and d > 1:
            # A zero stride repeats one element: a tiny descriptor could then make copy=True allocate
            # far more than the lease holds. Producers write contiguous tensors, so none is legitimate.
            raise DescriptorError("a zero stride on a dimension larger than 1 is refused")
        numel *= d
        last += (d - 1) * s
    if offset % TENSOR_ALIGNMENT:
        raise DescriptorError(f"tensor offset {offset} is not aligned to {TENSOR_ALIGNMENT} bytes, as every "
                              "producer packs tensors")
    extent = (last + 1) * itemsize if numel else 0
    if nbytes is not None and (offset + extent > nbytes or offset + numel * itemsize > nbytes):
        raise DescriptorError(
            f"tensor at offset {offset} ({numel} x {itemsize} B, extent {extent} B) overruns the {nbytes}-byte lease"
        )
    return TensorSpec.checked(dtype, tuple(shape), tuple(strides), offset)


def tensor_specs(tensors: Any, many: bool, nbytes: int) -> tuple[TensorSpec, ...]:
    if not isinstance(tensors, list) or not tensors or len(tensors) > MAX_TENSORS:
        raise DescriptorError(f"a descriptor holds 1 to {MAX_TENSORS} tensors")
    if not many and len(tensors) != 1:
        raise DescriptorError("a single-tensor descriptor must hold exactly one tensor")
    return tuple([spec_from_wire(t, nbytes) for t in tensors])


# The producer's side of the checks above, from the same limits: what put, put_many, reserve and dumps
# refuse before anything is placed, so that no producer makes a descriptor every consumer refuses (even
# for its ack, which left the feature's space pinned until ack_ttl). ValueError, as for a bad count of
# consumers: the caller's own arguments, not bytes from elsewhere.

def check_tensor_count(count: int) -> None:
    """Refuse a feature of a number of tensors no descriptor can name."""
    if not 1 <= count <= MAX_TENSORS:
        raise ValueError(f"a feature holds 1 to {MAX_TENSORS} tensors, not {count}: every consumer refuses a "
                         f"descriptor of more; send them as several features of at most {MAX_TENSORS}")


def packed_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a tensor of ``shape`` packed contiguously, as put writes it, once the shape is one
    a descriptor can name: at most the dimensions, and dimensions and strides at most the size, that
    ``spec_from_wire`` reads."""
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"a tensor of {len(shape)} dimensions {shape}: a descriptor names at most {_MAX_DIMS}, and "
                         f"every consumer refuses more; reshape it to {_MAX_DIMS} or fewer before it is sent, and "
                         "back after get")
    strides, step = [], 1
    for d in reversed(shape):
        if d > _MAX_INT:
            break
        strides.append(step)
        step *= max(d, 1)
    if len(strides) < len(shape) or strides and strides[-1] > _MAX_INT:
        raise ValueError(f"a tensor of shape {shape} has dimensions or strides past 2^62 elements, more than a "
                         "descriptor carries; send smaller tensors")
    return tuple(reversed(strides))


def check_packed_offset(offset: int) -> None:
    """Refuse a tensor that would start further into its feature than a descriptor can say."""
    if offset > _MAX_INT:
        raise ValueError(f"a tensor would start {offset} bytes into its feature, past the 2^62 a descriptor "
                         "carries; send the tensors as several features")
