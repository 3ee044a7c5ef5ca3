"""Client(readonly=True): consumers that map the pool read-only cannot change what other consumers read."""

from __future__ import annotations

import ctypes
import mmap
import signal

import pytest
import torch

from mmfeat.client import MmfeatError
from mmfeat.protos.errors import ErrorCode

from . import workers as w


def test_a_read_only_consumer_that_writes_in_place_dies_and_the_other_reads_the_right_bytes(daemon, children) -> None:
    with daemon.client() as c:
        desc = c.put(torch.full((1024, 256), 255.0), consumers=2)  # 1 MiB: in the pool, not inline
        results = children.SimpleQueue()  # written at once: a Queue's feeder thread dies with its process
        blob = desc.to_bytes()
        writer = children.Process(target=w.write_in_place, args=(str(daemon.runtime_dir), blob, True, results))
        writer.start()
        writer.join(60)
        assert not results.empty() and results.get() == ("read", 255.0)  # it had the view before it wrote
        assert writer.exitcode == -signal.SIGSEGV, f"the write in place did not fault: exit {writer.exitcode}"
        assert results.empty()
        reader = children.Process(target=w.read_max, args=(str(daemon.runtime_dir), blob, results))
        reader.start()
        reader.join(60)
        assert reader.exitcode == 0
        assert not results.empty() and results.get() == ("read", 255.0, 255.0)
        c.ack(desc)  # for the consumer that died
        assert c.flush()
        daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="both acks")


def test_a_read_only_client_reads_copies_and_acks_but_cannot_put_or_make_the_pool_writable(daemon) -> None:
    with daemon.client() as producer, daemon.client(readonly=True) as c:
        t = torch.arange(300_000, dtype=torch.float32)
        desc = producer.put(t)
        assert torch.equal(c.get(desc), t)
        private = c.get(desc, copy=True)
        private /= 2  # a private copy is writable
        assert torch.equal(c.get(desc), t)
        with pytest.raises(MmfeatError) as err:
            c.put(t)
        assert err.value.code is ErrorCode.FORBIDDEN and "readonly" in err.value.message
        with pytest.raises(MmfeatError):
            c.put_many([t])
        # The mapping came through a read-only fd: the kernel refuses to make it writable again.
        pool = c.session.mapping(desc.pool).tensor
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        assert libc.mprotect(pool.data_ptr(), mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) == -1
        c.ack(desc)
        assert c.flush()
        daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the read-only client's ack")
    with pytest.raises(TypeError):
        daemon.client(readonly="yes")
