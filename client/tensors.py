"""Between torch tensors and descriptor tensor specs: dtype names, and the views a spec names in a lease
or a pool, which a get makes and a put writes through."""

from __future__ import annotations

import torch

from mmfeat.protos.descriptor import TensorSpec
from mmfeat.protos.dtypes import DTYPE_SIZES

from .neutral import outside_inference

_TO_TORCH: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}
_FROM_TORCH: dict[torch.dtype, str] = {dt: name for name, dt in _TO_TORCH.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        raise TypeError(f"mmfeat cannot carry dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TO_TORCH[name]
    except KeyError:
        raise TypeError(f"this torch has no dtype {name!r}") from None


def view(base: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor ``spec`` names inside ``base`` (a uint8 tensor over the lease), without copying."""
    dtype = torch_dtype(spec.dtype)
    extent = spec.extent
    if extent == 0:
        return torch.empty(spec.shape, dtype=dtype, device=base.device)
    flat = base[spec.offset : spec.offset + extent].view(dtype)
    return flat.as_strided(spec.shape, spec.strides)


def pool_view(pool: torch.Tensor, lease_offset: int, spec: TensorSpec) -> torch.Tensor:
    """The tensor ``spec`` names in the lease at ``lease_offset`` of ``pool`` (a uint8 tensor over the
    whole pool): one ``as_strided`` on a view of the pool in the spec's dtype, made once per pool and
    dtype. torch checks the result against the pool's storage, whatever the spec says."""
    views = _typed_views(pool)
    hit = views.get(spec.dtype)
    if hit is None or hit[0].requires_grad:
        # Not yet made, or given a graph by an in-place op with a requires-grad operand on a view of it
        # (a consumer writing into a view, against the contract): every later view would inherit that
        # graph, so a clean one replaces it.
        hit = views[spec.dtype] = (_typed_view(pool, spec.dtype), DTYPE_SIZES[spec.dtype])
    typed, itemsize = hit
    if 0 in spec.shape:
        return torch.empty(spec.shape, dtype=typed.dtype, device=pool.device)
    start = lease_offset + spec.offset  # a multiple of the itemsize: leases are 256-byte aligned
    return typed.as_strided(spec.shape, spec.strides, start // itemsize)


def _typed_view(pool: torch.Tensor, dtype: str) -> torch.Tensor:
    """``pool`` viewed as ``dtype``, shared by every later put and get of the process: made outside
    inference mode (client/neutral.py says why), and of a detached alias of ``pool``, so that a graph
    an in-place op gives it stays on it and goes with it rather than reaching the pool's own tensor."""
    with outside_inference():
        return pool.detach().view(torch_dtype(dtype))


def _typed_views(pool: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    # Kept on the pool tensor itself, so the views go when the mapping goes; by dtype name, with the
    # itemsize, which is what a spec gives.
    views = getattr(pool, "_mmfeat_views", None)
    if views is None:
        views = {}
        pool._mmfeat_views = views  # type: ignore[attr-defined]
    return views
