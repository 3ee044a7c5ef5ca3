"""The lease table's layout, shared by the daemon (writer) and clients (readers). SPEC.md, section 4.

One 32-byte entry per lease slot after a 64-byte header. Word 0 of an entry is ``generation << 2 |
state``; words 1-3 are the live lease's pool, offset and size. The daemon writes words 1-3 before it
makes a new generation live in word 0, and clears word 0 first when the lease ends, so a reader that
sees the same word 0 before and after reading words 1-3 has read the range of that generation.
"""

from __future__ import annotations

import struct

MAGIC = b"MMFTABL2"
HEADER = struct.Struct("<8sQQQ")  # magic, epoch, slots, entry bytes; zero-padded to HEADER_BYTES
HEADER_BYTES = 64
ENTRY = struct.Struct("<QQQQ")  # generation << 2 | state, pool, offset, nbytes
ENTRY_BYTES = ENTRY.size
WORDS_PER_ENTRY = ENTRY_BYTES // 8
FREE, RESERVED, PUBLISHED = 0, 1, 2


def table_bytes(slots: int) -> int:
    return HEADER_BYTES + slots * ENTRY_BYTES


def entry_offset(slot: int) -> int:
    return HEADER_BYTES + slot * ENTRY_BYTES
