"""Processes that attack pins: hostile members of the daemon's group writing the lease table, and pinners
racing the daemon. Each is a real process of its own, with a Client of its own."""

from __future__ import annotations

import time
from typing import Any

from mmfeat.client import Client, Descriptor
from mmfeat.protos.lease_table import ACKS, LIVE_STATES, STATE, ack_word, word_offset


def _word(mm: Any, at: int) -> int:
    return int.from_bytes(mm[at:at + 8], "little")


def flapper(runtime_dir: str, blob: bytes, out_q: Any, stop: Any, limit_s: float = 60.0) -> None:
    """A hostile member: rewrite retained feature ``blob``'s ACKS word between 1 and 2 pins taken (none
    released) as long as its slot shows its generation live (``limit_s`` at most, or until ``stop``);
    report the number of rewrites."""
    desc = Descriptor.from_bytes(blob)
    c = Client(runtime_dir, map_pools=False)
    table = c._connect().table
    mm, slots = table.mm, table.slots
    state_at, acks_at = word_offset(slots, desc.lease, STATE), word_offset(slots, desc.lease, ACKS)
    out_q.put("started")
    n, end = 0, time.monotonic() + limit_s
    while time.monotonic() < end and stop.empty():
        state = _word(mm, state_at)
        if state >> 2 != desc.gen or state & 3 not in LIVE_STATES:
            break
        mm[acks_at:acks_at + 8] = ack_word(desc.gen, 1 + n % 2).to_bytes(8, "little")
        n += 1
        time.sleep(0.05)  # the attacker's pace: far below ack_ttl
    out_q.put(n)
