"""The tensors a descriptor names inside its lease, and the checks their wire form must pass (a spec
whose extent or element count leaves the lease is refused here, whatever the rest of the descriptor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .dtypes import DTYPE_SIZES

_MAX_DIMS = 16
MAX_TENSORS = 1024
_MAX_INT = 1 << 62  # shapes, strides and offsets: far past any real tensor, and products stay exact


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
    if offset % itemsize:
        raise DescriptorError(f"tensor offset {offset} is not aligned to its {dtype} elements")
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
