"""On a GPU: a cuda_vmm daemon, a producer of CUDA tensors, two consumers taking views and staged copies."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from ..conftest import assert_fds_settle, fd_count, start_daemon
from . import workers

pytestmark = pytest.mark.gpu


def test_cuda_pool_producer_two_consumers(runtime_dir) -> None:
    d = start_daemon(runtime_dir, "--pool-mb", "1024", backend="cuda_vmm")
    try:
        pool = d.pool()
        assert pool["kind"] == "cuda" and pool["handle"] == "posix_fd" and pool["device"] == 0
        daemon_fds = fd_count(d.pid)
        ctx = mp.get_context("spawn")
        q_prod, results = ctx.Queue(), ctx.Queue()
        q_cons = [ctx.Queue(), ctx.Queue()]
        cons = [ctx.Process(target=workers.consume, args=(r, str(runtime_dir), q, results))
                for r, q in enumerate(q_cons)]
        prod = ctx.Process(target=workers.produce, args=(str(runtime_dir), 2, q_prod))
        for p in (*cons, prod):
            p.start()
        while (item := q_prod.get(timeout=240)) is not None:
            for q in q_cons:
                q.put(item)
        for q in q_cons:
            q.put(None)
        out = [results.get(timeout=240) for _ in cons]
        assert q_prod.get(timeout=30)[0] == "fds"
        for p in (*cons, prod):
            p.join(60)
            assert p.exitcode == 0
        n = len(workers.SHAPES) * len(workers.DTYPES) + 2
        for r in out:
            assert r[0] == "ok", r
            assert r[1] == n
            assert r[3] <= r[2], f"consumer fds grew: {r}"
        s = d.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=30, what="GPU pool to empty")
        assert s["counters"]["frees"] == n and s["counters"]["over_acks"] == 0
        assert_fds_settle(d.pid, daemon_fds)
    finally:
        rc = d.stop()
        _, err = d.proc.communicate()
        assert rc == 0, err
        assert "CUDA VMM pool 0 with POSIX FD sharing" in err, err


def test_fabric_probe_verdict_is_clean() -> None:
    from mmfeat.daemon.pools.fabric_probe import probe_fabric

    verdict = probe_fabric(0)
    assert isinstance(verdict.ok, bool) and verdict.reason
    print(f"fabric probe on GPU 0: ok={verdict.ok}: {verdict.reason}")


def test_multinode_setting_without_fabric_falls_back_to_posix_fd(runtime_dir) -> None:
    from mmfeat.daemon.pools.fabric_probe import probe_fabric

    if probe_fabric(0).ok:
        pytest.skip("this node has a working NVLink fabric; the fallback branch does not apply")
    d = start_daemon(runtime_dir, "--pool-mb", "64", "--nnodes", "2", backend="cuda_vmm")
    try:
        assert d.pool()["handle"] == "posix_fd"
    finally:
        d.stop()
        _, err = d.proc.communicate()
    assert "cannot use FABRIC handles" in err
