"""On a GPU: reserve a tensor in the GPU pool, fill it with a kernel, publish it with no copy."""

from __future__ import annotations

import gc

import pytest
import torch

from ..conftest import start_daemon

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu_daemon(runtime_dir):
    d = start_daemon(runtime_dir, "--pool-mb", "256", backend="cuda_vmm")
    yield d
    rc = d.stop()
    _, err = d.proc.communicate()
    assert rc == 0, err


@pytest.mark.parametrize("numel", [1 << 18, 40 << 20], ids=["arena", "reserved_lease"])
def test_a_kernel_fills_a_reserved_gpu_tensor_and_its_consumer_reads_it_all(gpu_daemon, numel: int) -> None:
    """The reserved tensor is the GPU pool's memory on the producer's device; a consumer reads all of
    what the kernel queued on the current stream (behind a long sleep) writes: publish queues the READY
    word behind it and returns (ready_word), or returns once the kernel is done (host_wait)."""
    torch.cuda.set_device(0)
    with gpu_daemon.client(inline_threshold=0, fallback="error") as producer, gpu_daemon.client() as consumer:
        t = producer.reserve((numel,), torch.uint8, device="cuda:0")
        assert t.device == torch.device("cuda", 0)
        torch.cuda._sleep(int(5e8))
        torch.add(torch.full((numel,), 6, dtype=torch.uint8, device="cuda:0"), 1, out=t)
        desc = producer.publish(t)
        if producer.stats()["gpu_publish"] == "ready_word":
            assert not torch.cuda.current_stream(0).query(), "publish waited for the kernel on the host"
        pool = producer.session.mapping(desc.pool, 0).tensor
        assert desc.kind == "cuda" and t.data_ptr() == pool.data_ptr() + desc.offset + desc.tensors[0].offset
        got = consumer.get(desc, copy=True)
        assert int((got == 7).sum()) == numel, "publish did not wait for the kernel that filled the tensor"
        consumer.ack(desc)
        # Filled on a side stream and named with after=: the consumer's copy on the current stream is
        # ordered behind the fill only by the READY word (or publish's wait).
        side = torch.cuda.Stream(0)
        t2 = producer.reserve((numel,), torch.uint8, device="cuda:0")
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(5e8))
            torch.add(torch.full((numel,), 8, dtype=torch.uint8, device="cuda:0"), 1, out=t2)
        desc2 = producer.publish(t2, after=side)
        got = consumer.get(desc2, copy=True)
        assert int((got == 9).sum()) == numel, "publish(after=side) did not wait for the fill on the side stream"
        consumer.ack(desc2)
        del t2
        dropped = producer.reserve((numel,), torch.uint8, device=0)
        del dropped, t
        gc.collect()
    s = gpu_daemon.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="every lease ended")
    assert all(pool["used"] == 0 for pool in s["pools"]) and s["counters"]["fallbacks"] == {}
