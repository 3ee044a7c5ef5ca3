"""On a GPU: the orders only a real driver can show. Every space given back after the GPU work that
may still touch it (staged copies named or not by ack(after=)), a graph captured while the acker waits,
and what only a node with two GPUs shows (contexts on GPU 0, cross-device writes into a pool view)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ..conftest import start_daemon

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.fixture
def host_daemon(runtime_dir):
    d = start_daemon(runtime_dir, "--pool-mb", "256")
    yield d
    rc = d.stop()
    _, err = d.proc.communicate()
    assert rc == 0, err


@pytest.fixture
def gpu_daemon(runtime_dir):
    d = start_daemon(runtime_dir, "--pool-mb", "256", backend="cuda_vmm")
    yield d
    rc = d.stop()
    _, err = d.proc.communicate()
    assert rc == 0, err


def test_a_staged_copy_behind_a_kernel_outlives_an_ack_that_names_an_idle_stream(host_daemon) -> None:
    """The staged DMA from the host pool is queued on stream A behind a long kernel; the ack names an
    idle stream B. The next put rewrites the host range at once (a memmove), so an ack that forgot the
    copy lets the DMA read the next feature's bytes."""
    torch.cuda.set_device(0)
    a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
    with host_daemon.client(inline_threshold=0, fallback="error") as p, host_daemon.client() as c:
        src = torch.full((4 << 20,), 3, dtype=torch.uint8)
        d = p.put(src)
        with torch.cuda.stream(a):
            torch.cuda._sleep(int(1e9))
            mine = c.get(d, device=0)
        c.ack(d, after=b)
        for _ in range(16):
            p.ack(p.put(torch.full((4 << 20,), 250, dtype=torch.uint8)), wait=True)
        torch.cuda.synchronize()
        assert torch.equal(mine.cpu(), src), "the host range was reused under the queued staged copy"
        assert c.flush(30.0)


def test_two_staged_gets_on_two_streams_are_both_waited_for_by_one_ack(host_daemon) -> None:
    torch.cuda.set_device(0)
    a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
    with host_daemon.client(inline_threshold=0, fallback="error") as p, host_daemon.client() as c:
        src = torch.full((4 << 20,), 5, dtype=torch.uint8)
        d = p.put(src)
        with torch.cuda.stream(a):
            torch.cuda._sleep(int(1e9))
            first = c.get(d, device=0)
        with torch.cuda.stream(b):
            c.get(d, device=0)
        c.ack(d)
        for _ in range(16):
            p.ack(p.put(torch.full((4 << 20,), 250, dtype=torch.uint8)), wait=True)
        torch.cuda.synchronize()
        assert torch.equal(first.cpu(), src), "the ack waited for the second copy only"
        assert c.flush(30.0)


def test_a_graph_captured_while_the_acker_waits_is_not_invalidated(gpu_daemon) -> None:
    """torch.cuda.graph captures in global mode: the acker's wait in another thread must not count as
    an unsafe call (it runs in relaxed mode)."""
    torch.cuda.set_device(0)
    with gpu_daemon.client(inline_threshold=0, fallback="error") as p, gpu_daemon.client() as c:
        d = p.put(torch.ones(1 << 20, device="cuda:0"))
        work = torch.cuda.Stream(0)
        with torch.cuda.stream(work):
            torch.cuda._sleep(int(1e9))
        c.ack(d, after=work)  # the acker now waits for about a second
        x = torch.ones(1 << 16, device="cuda:0")
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(0)
        with torch.cuda.stream(side):
            for _ in range(20):  # capture for as long as the acker waits
                with torch.cuda.graph(graph):
                    y = x * 2
                graph.replay()
        torch.cuda.synchronize()
        assert float(y.sum()) == 2 * (1 << 16)
        assert c.flush(30.0)


_ONLY_GPU_1 = """
import sys, torch
from mmfeat import cuda_driver as drv
from mmfeat.client import Client
torch.cuda.set_device(1)
with Client(sys.argv[1]) as c:
    d = c.put(torch.ones(1 << 22, dtype=torch.uint8))
    got = c.get(d, device=1)
    s = torch.cuda.Stream(1)
    with torch.cuda.stream(s):
        torch.cuda._sleep(int(1e7))
    c.ack(d, after=s)
    assert c.flush(30.0)
print("context on GPU 0:", drv.has_context(0), flush=True)
"""


@two_gpus
def test_a_process_that_uses_only_gpu_1_makes_no_context_on_gpu_0(host_daemon) -> None:
    out = subprocess.run([sys.executable, "-c", _ONLY_GPU_1, str(host_daemon.runtime_dir)], capture_output=True,
                         text=True, timeout=120)
    assert "context on GPU 0: False" in out.stdout, out.stdout + out.stderr


@two_gpus
def test_a_put_of_tensors_on_two_gpus_writes_every_byte(gpu_daemon) -> None:
    with gpu_daemon.client(inline_threshold=0, fallback="error") as p, gpu_daemon.client() as c:
        a = torch.full((1 << 20,), 1, dtype=torch.uint8, device="cuda:0")
        b = torch.full((1 << 20,), 2, dtype=torch.uint8, device="cuda:1")
        d = p.put_many([a, b])
        got = c.get(d, copy=True)
        assert [int(t.sum()) for t in got] == [1 << 20, 2 << 20]
        c.ack(d, wait=True)
