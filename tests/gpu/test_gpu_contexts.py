"""On a GPU: the client's and the daemon's CUDA contexts. A mapping keeps its own reference to the
primary context and gives it back once, leaves the thread's current context as it found it, and never
creates a context on a GPU the process did not use. tests/test_cuda_fake_driver.py holds the same
guarantees call by call against a stand-in driver; these check them against the real one."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from mmfeat import cuda_driver as drv

from ..conftest import start_daemon

pytestmark = pytest.mark.gpu


def _current() -> int:
    return int(drv.ck("cuCtxGetCurrent", drv.cu.cuCtxGetCurrent()))


def _drop(cuda_import, endpoint: str) -> None:
    for key in [k for k in cuda_import._cache if k[1] == endpoint]:
        del cuda_import._cache[key]
    gc.collect()


@pytest.fixture
def gpu_daemon(runtime_dir):
    d = start_daemon(runtime_dir, "--pool-mb", "64", backend="cuda_vmm")
    yield d
    rc = d.stop()
    _, err = d.proc.communicate()
    assert rc == 0, err


def _pool_and_fd(client) -> tuple[dict, int]:
    session = client.session
    info = next(p for p in session.pools.values() if p.kind == "cuda")
    return info, os.dup(session.fds[info.pool])


def test_a_mapping_gives_the_thread_back_its_context_and_torch_keeps_working(gpu_daemon) -> None:
    from mmfeat.client.gpu import cuda_import

    torch.cuda.set_device(0)
    keep = torch.arange(1024, device="cuda:0")
    before = _current()
    assert before != 0, "torch made no context current"
    with gpu_daemon.client() as c:
        info, fd = _pool_and_fd(c)
        m = cuda_import.map_cuda_pool("contexts", info, fd)
        assert _current() == before
        m.tensor[:4096].fill_(7)
        torch.cuda.synchronize(0)
        del m
        _drop(cuda_import, "contexts")
    assert _current() == before
    assert int(keep.sum()) == 1023 * 1024 // 2


def test_a_failed_wrap_after_the_mapping_leaves_torchs_context_alive(gpu_daemon, monkeypatch) -> None:
    from mmfeat.client.gpu import cuda_import, dlpack

    torch.cuda.set_device(0)
    keep = torch.ones(1024, device="cuda:0")

    def refuse(*args: object, **kw: object) -> None:  # the one failure after the mapping exists
        raise RuntimeError("torch refused the capsule")

    monkeypatch.setattr(dlpack, "uint8_tensor", refuse)
    with gpu_daemon.client() as c:
        info, fd = _pool_and_fd(c)
        with pytest.raises(RuntimeError, match="refused the capsule"):
            cuda_import.map_cuda_pool("wrap-fails", info, fd)
    gc.collect()
    _flags, active = drv.ck("cuDevicePrimaryCtxGetState", drv.cu.cuDevicePrimaryCtxGetState(drv.device(0)))
    assert active, "the primary context torch uses was destroyed"
    assert int(keep.sum()) == 1024


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: the pool on one, the process on the other")
def test_unmapping_creates_no_context_on_the_pools_gpu_when_unused(runtime_dir) -> None:
    from mmfeat.client.gpu import cuda_import

    d = start_daemon(runtime_dir, "--pool-mb", "64", "--devices", "1", backend="cuda_vmm")
    try:
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda:0")
        assert not drv.has_context(1), "this process used GPU 1 before the test"
        with d.client() as c:
            info, fd = _pool_and_fd(c)
            m = cuda_import.map_cuda_pool("owner-unused", info, fd)
            del m
            _drop(cuda_import, "owner-unused")
        assert not drv.has_context(1), "mapping or unmapping the pool made a context on GPU 1"
    finally:
        rc = d.stop()
        _, err = d.proc.communicate()
        assert rc == 0, err
