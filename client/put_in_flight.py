"""One feature on its way into the pool: its layout, its consumers, and the tensors it comes from.

``put`` makes one per call and hands it through placement, reserve, write and fallback; a zero-copy
reservation (client/reservations.py) makes one when it reserves and keeps it until it is published,
so both paths make their descriptor, and fall back, from the same object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from mmfeat.protos.descriptor import Descriptor, TensorSpec
from mmfeat.protos.messages import TOKEN_BYTES, PoolInfo

from . import tensors as tz
from .arenas import Placement
from .session import Session


@dataclass(slots=True)
class PutInFlight:
    specs: tuple[TensorSpec, ...]
    nbytes: int
    many: bool
    consumers: int
    device: Optional[int]  # the local CUDA ordinal of the feature's memory; None on the host
    # What put copies from; empty for a reservation, which the caller fills in place.
    tensors: list[torch.Tensor] = field(default_factory=list)

    def descriptor(self, session: Session, endpoint: str, pool: int, lease: int, gen: int, token: bytes,
                   offset: int) -> Descriptor:
        """The descriptor of this feature placed at ``offset`` of ``pool``, as lease (or arena slot)
        ``lease`` of generation ``gen``."""
        info = session.pools[pool]
        return Descriptor.checked(kind=info.kind, tensors=self.specs, nbytes=self.nbytes, many=self.many,
                                  node=session.node, endpoint=endpoint, device=info.device, pool=pool,
                                  epoch=session.epoch, lease=lease, gen=gen, token=token, offset=offset, inline=None)

    def place_in_arena(self, session: Session, endpoint: str,
                       pool: PoolInfo) -> Optional[tuple[Placement, bytes, Descriptor]]:
        """Space for this feature in one of the session's arenas of ``pool``, the token it is published
        with and its descriptor; None where the session has no arena with room (then it reserves)."""
        arenas = session.arenas
        if arenas is None:
            return None
        placed = arenas.place(pool.pool, pool.device, self.nbytes)
        if placed is None:
            return None
        token = os.urandom(TOKEN_BYTES)
        return placed, token, self.descriptor(session, endpoint, pool.pool, placed.slot, placed.gen, token,
                                              placed.offset)

    def inline(self) -> Descriptor:
        """The descriptor that carries the bytes themselves, copied once: from each tensor's memory
        straight into the bytes ``to_bytes`` returns (a tensor that is not dense host memory is made so
        first)."""
        parts = tz.packed_parts(self.tensors, self.specs, self.nbytes)
        return Descriptor.inline_of(self.specs, self.nbytes, self.many, parts)
