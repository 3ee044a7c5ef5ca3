"""The Client's argument checks: what a call is given is refused, typed, before anything is made or sent."""

from __future__ import annotations

from typing import Any

import torch

from mmfeat.protos.descriptor import Descriptor, DescriptorError
from mmfeat.protos.errors import ErrorCode, MmfeatError

# A Descriptor, or its bytes in bytes or any buffer (a memoryview, a zmq Frame): Any, since typing has no
# name for "supports the buffer protocol" before Python 3.12.
DescLike = Any


def check_device(device: Any) -> None:
    """Refuse a ``device`` that names no device before a get makes anything: torch's own error would come
    from the middle of the copy, as an untyped RuntimeError."""
    if type(device) is int:
        if device < 0:
            raise ValueError(f"device must be a CUDA device's index (>= 0), not {device}")
        return  # an index of a CUDA device, which torch.device() reads as one only where torch has CUDA
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be None, an int, 'cuda:N' or a torch.device, not {device!r}") from None


def check_wait(wait: object) -> bool:
    if not isinstance(wait, bool):
        raise TypeError(f"wait must be True or False, not {wait!r}")
    return wait


def as_descriptor(desc: DescLike) -> Descriptor:
    if isinstance(desc, Descriptor):
        return desc
    try:
        # bytes, or a buffer as it arrived (a zmq Frame received with copy=False): an inline payload is
        # viewed in it, not copied.
        return Descriptor.from_bytes(desc)
    except DescriptorError as exc:
        if not isinstance(desc, (bytes, bytearray, memoryview)) and not is_buffer(desc):
            raise TypeError(f"expected a Descriptor or its bytes, got {type(desc).__name__}") from None
        raise MmfeatError(ErrorCode.BAD_REQUEST, str(exc)) from None


def is_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def check_stream(stream: Any) -> None:
    """Refuse a ``stream`` that is not a CUDA stream (a get's view is read on it): its READY wait would
    otherwise be queued nowhere the reads follow."""
    if not (hasattr(stream, "cuda_stream") and hasattr(stream, "device_index")):
        raise TypeError(f"stream must be a torch.cuda.Stream, or None for the current one, not {type(stream).__name__}")
