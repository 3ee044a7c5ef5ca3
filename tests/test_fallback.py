"""Inline fallback: pool full, below the threshold, daemon unreachable; fallback='error' raises."""

from __future__ import annotations

import logging

import pytest
import torch

from mmfeat.client import Client
from mmfeat.protos import DaemonUnavailableError, ErrorCode, MmfeatError


def test_pool_full_falls_back_inline_and_is_counted(daemon_factory, caplog) -> None:
    d = daemon_factory("--pool-mb", "1")
    big = torch.ones(200_000, dtype=torch.float32)  # 800 KB: one fits in 1 MiB, two do not
    with d.client(inline_threshold=0) as c:
        first = c.put(big)
        with caplog.at_level(logging.WARNING, logger="mmfeat.client"):
            second = c.put(big)
            third = c.put(big)
        assert not first.is_inline and second.is_inline and third.is_inline
        assert [r.message.count("pool_full") for r in caplog.records] == [1], "warn once, with the reason"
        assert torch.equal(c.get(second), big) and c.ack(second, wait=True)["freed"]
        assert c.fallbacks["pool_full"] == 2
        c.ack(first)
    s = d.wait_for(lambda s: s["counters"]["fallbacks"].get("pool_full") == 2, what="fallback report")
    assert s["counters"]["pool_full"] == 2 and s["pools"][0]["used"] == 0


def test_fallback_error_raises_pool_full_and_too_large(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "1")
    with d.client(inline_threshold=0, fallback="error") as c:
        keep = c.put(torch.ones(200_000))
        with pytest.raises(MmfeatError) as info:
            c.put(torch.ones(200_000))
        assert info.value.code is ErrorCode.POOL_FULL and "inline" in info.value.message
        with pytest.raises(MmfeatError) as info:
            c.put(torch.ones(1_000_000))
        assert info.value.code is ErrorCode.TOO_LARGE
        c.ack(keep)
    assert d.pool()["used"] == 0


def test_below_threshold_goes_inline_without_touching_the_pool(daemon) -> None:
    with daemon.client(inline_threshold=4096) as c:
        small = torch.arange(10, dtype=torch.int16)
        desc = c.put(small)
        assert desc.is_inline and len(desc.to_bytes()) < 200
        assert torch.equal(c.get(desc.to_bytes()), small)
        assert c.ack(desc, wait=True)["freed"]
    assert daemon.stats()["counters"]["reserves"] == 0


def test_unreachable_daemon_falls_back_or_raises(tmp_path) -> None:
    t = torch.ones(100_000)
    with Client(tmp_path, timeout=0.5, inline_threshold=0) as c:
        desc = c.put(t)
        assert desc.is_inline and c.fallbacks["unreachable"] == 1
        assert torch.equal(Client(tmp_path).get(desc), t)
        with pytest.raises(DaemonUnavailableError):
            c.stats()
    with Client(tmp_path, timeout=0.5, inline_threshold=0, fallback="error") as c:
        with pytest.raises(DaemonUnavailableError):
            c.put(t)


def test_hung_daemon_times_out(daemon) -> None:
    import signal
    import time

    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        with daemon.client(timeout=0.5, inline_threshold=0) as c:
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailableError):
                c.stats()
            assert time.monotonic() - t0 < 10  # 0.5 s asked; generous for a loaded machine, far from a hang
            assert c.put(torch.ones(100_000)).is_inline  # a producer keeps going
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert daemon.stats()["pools"][0]["used"] == 0


def test_inline_views_from_bytes_raise_no_warning(tmp_path) -> None:
    # A view over received (immutable) bytes must not warn on the first get, nor swap the warning
    # filters on every get: run where any UserWarning is an error.
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from mmfeat.client import Client\n"
        f"c = Client({str(tmp_path)!r}, inline_threshold=1 << 30)\n"
        "b = c.put(torch.arange(10, dtype=torch.bfloat16)).to_bytes()\n"
        "assert torch.equal(c.get(b), torch.arange(10, dtype=torch.bfloat16))\n"
    )
    r = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
