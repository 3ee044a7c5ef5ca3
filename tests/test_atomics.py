"""The memory-ordering helpers the shared-memory path rests on (mmfeat.atomics), across two processes."""

from __future__ import annotations

import mmap
import os

import pytest

from mmfeat import atomics

pytestmark = pytest.mark.skipif(not atomics.AVAILABLE, reason="libatomic not found: clients use the message path")

PAYLOAD = 4096
ROUNDS = 20_000


# Both ways of ordering a load or store that this machine can run: libatomic's calls (every
# architecture) and, on x86-64, the plain moves that clients and the daemon use there.
ORDERINGS = [pytest.param(False, id="libatomic"),
             pytest.param(True, id="plain-x86-64", marks=pytest.mark.skipif(
                 not atomics.PLAIN_ORDERED, reason="plain moves are acquire/release only on x86-64"))]


@pytest.mark.parametrize("plain", ORDERINGS)
def test_load_store_and_compare_and_swap(plain: bool) -> None:
    mm = mmap.mmap(-1, 4096)
    words = atomics.Words(mm, 64, 8, plain=plain)
    try:
        words.store(3, 2**64 - 1)
        assert words.load(3) == 2**64 - 1 and int.from_bytes(mm[88:96], "little") == 2**64 - 1
        assert words.cas(3, 5, 7) == (False, 2**64 - 1)
        assert words.cas(3, 2**64 - 1, 7) == (True, 2**64 - 1) and words.load(3) == 7
        with pytest.raises(IndexError):
            words.load(8)
    finally:
        words.close()
        mm.close()  # the exported pointer is gone: the mapping closes


@pytest.mark.parametrize("plain", ORDERINGS)
def test_a_release_store_publishes_the_writes_before_it_to_another_process(plain: bool) -> None:
    """The publish/ack handshake in miniature: a producer writes a payload with plain stores, then
    release-stores its sequence number; the consumer acquire-loads it, checks every payload byte, and
    release-stores its ack, after which the producer may overwrite the payload. On x86-64 the hardware
    keeps this order anyway; on aarch64 it holds only through the helpers."""
    fd = os.memfd_create("mmfeat-ordering")
    os.ftruncate(fd, 64 + PAYLOAD)
    mm = mmap.mmap(fd, 64 + PAYLOAD, flags=mmap.MAP_SHARED)
    pid = os.fork()
    if pid == 0:  # the consumer
        words = atomics.Words(mm, 0, 8, plain=plain)
        status = 0
        try:
            for seq in range(1, ROUNDS + 1):
                while words.load(0) != seq:
                    pass
                if mm[64 : 64 + PAYLOAD] != bytes([seq & 0xFF]) * PAYLOAD:
                    status = 1
                    break
                words.store(1, seq)
        finally:
            os._exit(status)
    words = atomics.Words(mm, 0, 8, plain=plain)
    try:
        for seq in range(1, ROUNDS + 1):
            mm[64 : 64 + PAYLOAD] = bytes([seq & 0xFF]) * PAYLOAD
            words.store(0, seq)
            while words.load(1) != seq:
                pass
        assert os.waitpid(pid, 0)[1] == 0, "the consumer saw a sequence number before its payload"
    finally:
        words.close()
        mm.close()
        os.close(fd)


@pytest.mark.parametrize("plain", ORDERINGS)
def test_dropping_the_words_lets_the_mapping_close(plain: bool) -> None:
    """Client lease tables are unmapped when the last reference goes (an older epoch's table): the
    helpers must hold no reference cycle that would keep the mapping exported until a GC pass."""
    import gc

    mm = mmap.mmap(-1, 4096)
    words = atomics.Words(mm, 0, 8, plain=plain)
    words.store(1, 9)
    gc.disable()
    try:
        del words
        mm.close()  # raises BufferError while anything still exports a pointer into the mapping
    finally:
        gc.enable()


def test_dropping_a_lease_table_view_lets_its_mapping_close() -> None:
    """The same for the client's writable view of the table, which binds its load function once."""
    import gc

    from mmfeat.client.link.lease_table import LeaseTableView
    from mmfeat.protos.lease_table import table_bytes

    mm = mmap.mmap(-1, table_bytes(16))
    view = LeaseTableView(mm, 16, True)
    assert view.state_word(3) == 0
    gc.disable()
    try:
        del view
        mm.close()
    finally:
        gc.enable()


def test_loading_the_c_libraries_forks_nothing() -> None:
    """libatomic in every client and libc's malloc_trim and getifaddrs in the daemon load without a
    subprocess: find_library forks ldconfig, which a sandboxed unit or slim image may lack, and which
    the daemon would otherwise fork from its serving loop at its first trim."""
    import subprocess
    import sys

    code = """
import subprocess
def refuse(*args, **kwargs):
    raise AssertionError(f"a subprocess was started: {args}")
subprocess.Popen = refuse
from mmfeat import atomics
assert atomics.AVAILABLE
from mmfeat.daemon.sockets.budgets import malloc_trim
malloc_trim()
from mmfeat.daemon.mesh.data_plane import interface_addresses
assert interface_addresses()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
