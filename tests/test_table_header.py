"""A member of the group rewrites the lease table's header (every member maps it read-write): new
clients take the table's shape from hello and still put through the pool, old ones keep working, and
the daemon puts the header back on its next sweep (SPEC.md, section 9)."""

from __future__ import annotations

import struct
import subprocess
import sys
import threading

import torch

from mmfeat.protos.lease_table import FLAG_DRAINING, HEADER, HEADER_BYTES, HEADER_FLAGS_WORD, MAGIC

from .test_table_attacks import HostileTable

_NEW_CLIENT = """
import sys, torch
from mmfeat.client import Client
with Client(sys.argv[1], timeout=5.0, inline_threshold=0) as c:
    desc = c.put(torch.arange(1000, dtype=torch.float32))
    print(desc.is_inline, dict(c.fallbacks))
"""


def _new_process_puts(runtime_dir) -> str:
    done = subprocess.run([sys.executable, "-c", _NEW_CLIENT, str(runtime_dir)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_rewritten_header_locks_no_client_out_and_is_put_back(daemon) -> None:
    with daemon.client(inline_threshold=0) as old, daemon.client() as reader:
        old.put(torch.ones(10))  # mapped the table before the attack
        hostile = HostileTable(daemon, old)
        try:
            good = bytes(hostile.mm[:HEADER_BYTES])
            magic, epoch, slots, entry, flags = HEADER.unpack_from(good, 0)
            assert magic == MAGIC and flags == 0
            stop = threading.Event()

            def attack() -> None:  # faster than the daemon's sweeps put it back
                while not stop.wait(0.001):
                    struct.pack_into("<8sQ", hostile.mm, 0, b"GARBAGE!", epoch ^ 0xFFFF)
                    struct.pack_into("<Q", hostile.mm, 8 * HEADER_FLAGS_WORD, FLAG_DRAINING)

            attacker = threading.Thread(target=attack)
            attacker.start()
            try:
                # A new process maps the rewritten header: its put goes through the pool all the same.
                assert _new_process_puts(daemon.runtime_dir) == "False {}"
                desc = old.put(torch.arange(64, dtype=torch.int64))
                assert not desc.is_inline and torch.equal(reader.get(desc), torch.arange(64))
                reader.ack(desc)
            finally:
                stop.set()
                attacker.join()
            s = daemon.stats()  # a request: the daemon sweeps, and puts the header back
            assert bytes(hostile.mm[:HEADER_BYTES]) == good
            assert s["counters"]["bad_table_words"] >= 1
            desc = old.put(torch.arange(64, dtype=torch.int64))
            assert not desc.is_inline and torch.equal(reader.get(desc), torch.arange(64))
            reader.ack(desc)
            assert _new_process_puts(daemon.runtime_dir) == "False {}"
        finally:
            hostile.close()
