"""On a GPU: features published behind their producer's stream (the lease table's READY word), read in
another process whose stream waits for the word (client/gpu/ready_word.py)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from ..conftest import start_daemon
from . import workers

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["auto", "host_wait"])
def test_a_consumer_reads_a_feature_put_behind_a_kernel_whole(runtime_dir, mode: str) -> None:
    """With READY words the put returns while the kernel that fills the tensor still runs, and the
    consumer's stream, not its host, waits for the bytes; with host_wait the put waits. Either way the
    consumer reads every byte of the fill, never the previous round's."""
    d = start_daemon(runtime_dir, "--pool-mb", "256", "--gpu-publish", mode, backend="cuda_vmm")
    try:
        torch.cuda.set_device(0)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        prod = ctx.Process(target=workers.produce_behind_a_kernel, args=(str(runtime_dir), 3, q))
        prod.start()
        with d.client() as c:
            stats = c.stats()
            assert stats["gpu_publish"] == ("ready_word" if mode == "auto" else "host_wait")
            while (item := q.get(timeout=120)) is not None:
                took, value, blob = item
                print(f"{mode}: put behind a kernel returned in {took * 1e3:.1f} ms")
                if mode == "auto":
                    assert took < 0.2, "the put waited for the kernel on the host"
                else:
                    assert took > 0.2, "the put returned before its fill was done"
                view = c.get(blob)
                assert int((view == value).sum()) == view.numel(), "read before the producer's fill landed"
                c.ack(blob, after=torch.cuda.current_stream())
        prod.join(60)
        assert prod.exitcode == 0
        s = d.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="every lease ended")
        assert s["counters"]["unready_ended"] == 0
    finally:
        d.stop()


def test_a_relay_of_a_pool_view_is_whole_after_the_source_is_acked(runtime_dir) -> None:
    """``put(get(desc))`` then ``ack(desc)``: the source is pool memory torch's allocator does not own,
    so ``record_stream`` keeps it for no one; the relay's put waits for its copy instead, and a put that
    takes the source's range at once cannot reach the relayed bytes."""
    d = start_daemon(runtime_dir, "--pool-mb", "256", backend="cuda_vmm")
    try:
        torch.cuda.set_device(0)
        with d.client() as c:
            for round_ in range(5):
                src = c.put(torch.full((4 << 20,), float(round_ + 1), device="cuda:0"))  # 16 MiB
                torch.cuda._sleep(int(2e8))  # the relay's copy queued behind GPU work
                relayed = c.put(c.get(src))
                c.ack(src)
                other = c.put(torch.zeros(4 << 20, device="cuda:0"))  # may take the source's space at once
                view = c.get(relayed)
                assert bool((view == float(round_ + 1)).all()), "the relay copied bytes of the next feature"
                c.ack(relayed, after=torch.cuda.current_stream())
                c.ack(other)
    finally:
        d.stop()


def test_a_keyed_feature_put_in_the_arena_is_whole_through_a_hold(runtime_dir) -> None:
    """A retained feature put with ``wait=False`` goes into the producer's arena; a hold on its key is a
    slot of its own, whose READY word the daemon stores at once: so the put publishes it written (a host
    wait), never behind its stream, or a reader through the hold would read before the fill landed."""
    d = start_daemon(runtime_dir, "--pool-mb", "256", backend="cuda_vmm")
    try:
        torch.cuda.set_device(0)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        prod = ctx.Process(target=workers.put_keyed_behind_a_kernel, args=(str(runtime_dir), 3, q))
        prod.start()
        with d.client() as c:
            while (item := q.get(timeout=120)) is not None:
                key, value, inline = item
                assert not inline, "the keyed feature went inline, not into the arena"
                hold = c.hold(key)
                assert hold is not None, f"nothing live under {key}"
                view = c.get(hold)
                assert int((view == value).sum()) == view.numel(), "read through the hold before the fill landed"
                c.ack(hold, after=torch.cuda.current_stream())
        prod.join(60)
        assert prod.exitcode == 0
    finally:
        d.stop()
