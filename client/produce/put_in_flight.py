"""One feature on its way into the pool: its layout, its consumers, and the tensors it comes from.

``put`` makes one per call and hands it through placement, reserve, write and fallback; a zero-copy
reservation (client/produce/reservations.py) makes one when it reserves and keeps it until it is published,
so both paths make their descriptor, and fall back, from the same object.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from mmfeat.protos.descriptor import Descriptor, TensorSpec
from mmfeat.protos.descriptor_parts import head_fields
from mmfeat.protos.messages import TOKEN_BYTES, PoolInfo

from . import packing
from ..link.arenas import Placement
from ..link.session import Session


# A feature's token (the capability to ack or release it) comes from the kernel's CSPRNG, drawn for this
# many tokens at once, so that a put makes no getrandom() system call of its own. Per thread; a forked
# child drops its parent's draw, so that no token is handed out by both.
_TOKENS_PER_DRAW = 64


class _Tokens(threading.local):
    def __init__(self) -> None:
        self.drawn = b""
        self.at = 0


_tokens = _Tokens()


def _forget_tokens() -> None:
    global _tokens
    _tokens = _Tokens()


os.register_at_fork(after_in_child=_forget_tokens)


def new_token() -> bytes:
    """A fresh, unpredictable token of TOKEN_BYTES."""
    tokens = _tokens
    at = tokens.at
    if at >= len(tokens.drawn):
        tokens.drawn, at = os.urandom(TOKEN_BYTES * _TOKENS_PER_DRAW), 0
    tokens.at = at + TOKEN_BYTES
    return tokens.drawn[at : at + TOKEN_BYTES]


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
        heads = session.descriptor_heads
        head = heads.get((pool, endpoint))
        if head is None:  # once per pool: every descriptor of it has the same six first fields
            info = session.pools[pool]
            head = heads[(pool, endpoint)] = head_fields(info.kind, session.node, endpoint, info.device, pool,
                                                         session.epoch)
        return Descriptor.of_pool(head, tensors=self.specs, nbytes=self.nbytes, many=self.many, lease=lease, gen=gen,
                                  token=token, offset=offset)

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
        try:
            token = new_token()
            return placed, token, self.descriptor(session, endpoint, pool.pool, placed.slot, placed.gen, token,
                                                  placed.offset)
        except BaseException:  # an interrupt here would otherwise hold the slot, and its ring, until the end
            arenas.abandon(placed)
            raise

    def inline(self) -> Descriptor:
        """The descriptor that carries the bytes themselves, copied once: from each tensor's memory
        straight into the bytes ``to_bytes`` returns (a tensor that is not dense host memory is made so
        first)."""
        parts = packing.packed_parts(self.tensors, self.specs, self.nbytes)
        return Descriptor.inline_of(self.specs, self.nbytes, self.many, parts)
