"""One feature on its way into the pool: its layout, its consumers, and the tensors it comes from.

``put`` makes one per call and hands it through placement, reserve, write and fallback; a zero-copy
reservation (client/reservations.py) makes one when it reserves and keeps it until it is published,
so both paths make their descriptor, and fall back, from the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from mmfeat.protos.descriptor import Descriptor, TensorSpec

from . import tensors as tz
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

    def inline(self) -> Descriptor:
        """The descriptor that carries the bytes themselves: one copy into a bytearray msgpack packs as-is."""
        buf = bytearray(self.nbytes)
        if self.nbytes:
            tz.write_packed(torch.frombuffer(buf, dtype=torch.uint8), [t.cpu() for t in self.tensors], self.specs)
        return Descriptor(kind="inline", tensors=self.specs, nbytes=self.nbytes, many=self.many, inline=buf)
