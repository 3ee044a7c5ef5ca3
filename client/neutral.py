"""Tensors over the pool made the same way whatever autograd mode the caller is in.

A tensor over pool memory that outlives the call making it (a mapping's tensor, its typed views, a
reservation's or a Parcel's storage) is shared by every later put and get of the process. Made inside
``torch.inference_mode()`` it would be an inference tensor, and so would every view of it: no later
in-place copy outside that mode could write it, and every view handed out later would carry the flag.
Copies into the pool run under ``no_grad`` from a detached source: recorded, they give the shared
views a graph that every later view would inherit and that is never freed.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

_NOTHING = contextlib.nullcontext()


def outside_inference() -> ContextManager[object]:
    """Leave inference mode for the block where the caller is in it (a C call where it is not: a get
    pays nothing for it)."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else _NOTHING


def ungraphed(t: torch.Tensor) -> torch.Tensor:
    """``t`` for reading alone, without its autograd history: what a copy into the pool copies from."""
    return t.detach() if t.requires_grad else t
