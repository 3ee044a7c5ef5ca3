"""A put's packing: the layout of tensors packed one after another in a lease, and writing them there
or into the buffers of an inline descriptor."""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

from mmfeat.protos.descriptor import TensorSpec
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.tensor_spec import check_packed_offset, check_tensor_count, packed_strides

from ..neutral import ungraphed
from ..tensors import dtype_name, pool_view

# Every packed tensor starts on this boundary, as leases do, so any dtype view is aligned.
PACK_ALIGNMENT = 256

# The specs of tensors packed one after another, and their size in bytes.
Layout = tuple[tuple[TensorSpec, ...], int]

# One tensor's spec and size by (dtype, shape). A server puts a few shapes over and over, and building a
# spec was a sixth of put()'s Python; cleared when full, which costs a rebuild per shape.
LAYOUT_CACHE_ENTRIES = 1024
_one: dict[tuple[torch.dtype, torch.Size], Layout] = {}


def layout_cache_len() -> int:
    """How many single-tensor layouts ``layout`` keeps now (at most LAYOUT_CACHE_ENTRIES)."""
    return len(_one)


def layout(tensors: Sequence[torch.Tensor]) -> Layout:
    """Specs for ``tensors`` packed contiguously one after another, and the total size in bytes. One
    tensor of a shape seen before gets the same tuple of specs again: the descriptor's encoder keeps
    the bytes of a tuple it has encoded."""
    if len(tensors) == 1 and isinstance(tensors[0], torch.Tensor):
        t = tensors[0]
        key = (t.dtype, t.shape)
        hit = _one.get(key)
        if hit is None:
            hit = _layout(tensors)
            if len(_one) >= LAYOUT_CACHE_ENTRIES:
                _one.clear()
            _one[key] = hit
        return hit
    return _layout(tensors)


def _layout(tensors: Sequence[torch.Tensor]) -> Layout:
    # Every limit a consumer's parse enforces is checked here, from the same constants (protos'
    # tensor_spec), before anything is placed: every producer's path starts with its layout.
    check_tensor_count(len(tensors))
    specs, offset = [], 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        offset = -(-offset // PACK_ALIGNMENT) * PACK_ALIGNMENT
        check_packed_offset(offset)
        shape = tuple(t.shape)
        specs.append(TensorSpec.checked(dtype_name(t.dtype), shape, packed_strides(shape), offset))
        offset += t.numel() * t.element_size()
    return tuple(specs), offset


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of ``t`` made contiguous (one copy only when it was not already)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def packed_parts(tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec], nbytes: int) -> list[Any]:
    """The ``nbytes`` packed bytes of ``tensors`` as buffers to join at once, while ``tensors`` live:
    each tensor's own memory where it is dense host memory (no copy here), and zero padding up to each
    spec's offset and to the end."""
    parts: list[Any] = []
    at = 0
    for t, spec in zip(tensors, specs):
        n = t.numel() * t.element_size()
        if not n:
            continue
        if spec.offset > at:
            parts.append(bytes(spec.offset - at))
        if dense_host(t):
            # A ctypes array over the tensor's memory: far cheaper to make than torch's views or numpy's,
            # and made per feature on the inline path; it holds no reference, hence "while tensors live".
            address = t.data_ptr()
            if not address:
                raise _no_memory(t)
            parts.append((ctypes.c_char * n).from_address(address))
        else:
            host = t.detach().cpu().resolve_conj().resolve_neg()
            # numpy has no bfloat16 or float8: every tensor goes out as its bytes, a uint8 view.
            parts.append(as_bytes(host).numpy())
        at = spec.offset + n
    if nbytes > at:
        parts.append(bytes(nbytes - at))
    return parts


def write_into_pool(pool: torch.Tensor, lease_offset: int, tensors: Sequence[torch.Tensor],
                    specs: Sequence[TensorSpec]) -> None:
    """Copy each tensor into its packed place in the lease (copy_ reads any layout or device)."""
    for t, spec in zip(tensors, specs):
        if not t.numel():
            continue
        if not pool.is_cuda and dense_host(t):  # host memory that holds exactly the packed bytes
            copy_to_host_pool(pool, lease_offset + spec.offset, t, spec.extent)
        else:
            with torch.no_grad():  # recorded, the copy would give the shared typed view a graph
                pool_view(pool, lease_offset, spec).copy_(ungraphed(t))


def copy_to_host_pool(pool: torch.Tensor, start: int, t: torch.Tensor, n: int) -> None:
    """Copy the ``n`` bytes of ``t`` (``dense_host``) to ``start`` in a host pool: one memmove, a tenth of
    the instructions of a view and copy_ (torch's dispatch), per feature, and the same bytes. memmove
    checks nothing, so the bounds that as_strided would check are checked here, and ``n``, the size of
    the lease made for ``t``, against ``t``'s size now: another thread may have resized ``t`` since.
    The lease is written only as far as it goes, and the tensor read only as far as it goes."""
    if t.nbytes != n:
        raise MmfeatError(ErrorCode.BAD_REQUEST, f"the tensor changed size while put copied it ({n} B when its "
                          f"space was made, {t.nbytes} B now): another thread resized it; put it again, or do "
                          "not resize a tensor until its put returns")
    if start < 0 or start + n > pool.numel():
        raise RuntimeError(f"{n} bytes at {start} do not fit the {pool.numel()}-byte pool")
    address = t.data_ptr()
    if not address:
        raise _no_memory(t)
    ctypes.memmove(pool.data_ptr() + start, address, n)


def _no_memory(t: torch.Tensor) -> MmfeatError:
    # A tensor subclass that claims host memory yet has none (a FakeTensor, under torch.compile's tracing)
    # passes dense_host; the raw read of its address, 0, would kill the process.
    return MmfeatError(ErrorCode.BAD_REQUEST, f"a {type(t).__name__} of {t.nbytes} B on {t.device} has no memory "
                       "(its data_ptr is 0): put a tensor with real data, not a fake or traced one")


def dense_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds exactly its packed bytes: dense, in host memory (not a GPU's, and not
    a meta tensor's, which has no memory: its address is 0), without a lazy conjugate or negation bit."""
    return (t.is_cpu and t.layout is torch.strided and t.is_contiguous() and not t.is_conj()
            and not t.is_neg())
