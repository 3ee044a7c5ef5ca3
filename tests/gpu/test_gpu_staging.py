"""On a GPU: features made on the CPU live in the host pool beside the GPU pool, and a consumer's
get(device=) copies them into its HBM from pinned pages on its current stream, without waiting; its ack
waits for that copy instead."""

from __future__ import annotations

import pytest
import torch

from ..conftest import start_daemon

pytestmark = pytest.mark.gpu


@pytest.fixture
def staging_daemon(runtime_dir):
    d = start_daemon(runtime_dir, "--pool-mb", "64", "--host-pool-mb", "256", backend="cuda_vmm")
    yield d
    rc = d.stop()
    _, err = d.proc.communicate()
    assert rc == 0, err


def test_a_cpu_feature_is_staged_from_pinned_pages_with_every_byte(staging_daemon) -> None:
    from mmfeat.client.consume.pinned import pinned_view

    torch.cuda.set_device(0)
    x = torch.randint(0, 255, (4096, 16 << 10), dtype=torch.uint8)  # 64 MiB
    with staging_daemon.client(inline_threshold=0) as producer, staging_daemon.client() as consumer:
        desc = producer.put(x, consumers=1)
        assert desc.kind == "host", "a CPU tensor went to the GPU pool"
        got = consumer.get(desc, device=0)
        assert got.device == torch.device("cuda", 0)
        torch.cuda.current_stream().synchronize()
        assert torch.equal(got.cpu(), x)
        mapping = consumer.session.mapping(desc.pool)
        pinned = pinned_view(mapping, 0)
        assert pinned is not None and pinned.is_pinned(), mapping.pin_error
        for _ in range(3):
            consumer.get(desc, device=0)
        assert pinned_view(mapping, 0) is pinned  # one registration per mapping, not per get
        consumer.ack(desc)
        assert consumer.flush(10)
        staging_daemon.wait_for(lambda s: sum(s["leases"].values()) == 0, timeout=10, what="the feature freed")


def test_the_get_does_not_wait_for_the_copy_and_the_ack_waits_for_it(staging_daemon) -> None:
    torch.cuda.set_device(0)
    x = torch.arange(16 << 20, dtype=torch.int32)
    with staging_daemon.client(inline_threshold=0) as producer, staging_daemon.client() as consumer:
        desc = producer.put(x, consumers=1)
        consumer.get(desc, device=0)  # pins the pool, outside what is measured below
        stream = torch.cuda.current_stream()
        stream.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the copy
        got = consumer.get(desc, device=0)
        busy = not stream.query()
        consumer.ack(desc)  # deferred to the copy's event
        held = consumer.request("lookup", lease=desc.lease_ref())
        print(f"after get(device=0) the stream was {'still busy' if busy else 'idle'}; lease {held.get('state')}")
        assert busy, "get(device=) waited for the GPU: the host thread was blocked"
        assert held["state"] == "PUBLISHED", "the ack was applied before the copy completed"
        stream.synchronize()
        assert torch.equal(got.cpu(), x)
        assert consumer.flush(10)
        staging_daemon.wait_for(lambda s: sum(s["leases"].values()) == 0, timeout=10, what="the ack after the copy")
