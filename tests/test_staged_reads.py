"""A staged get by key (a host-pool feature copied into a GPU on the consumer's stream, without waiting)
reads the feature's own bytes or raises, however long its copy stays queued: on the fake driver
(tests/fake_cuda), whose streams hold a copy back until the kernel before it is released, a producer
of its own puts the feature, the consumer's get queues its copy behind a kernel, and another producer's
put needs the feature's space before the copy runs."""

from __future__ import annotations

from pathlib import Path

import torch

from mmfeat.client import Client, Namespace

from . import fake_cuda
from .conftest import Daemon

NS = Namespace(framework="test", version="1", model="staged", dtype="float32")
NUMEL = 9 * (1 << 20) // 4  # 9 MiB of float32: the 16 MiB pool holds one such feature, never two


def _run(fake_libcuda: Path, tmp_path: Path, d: Daemon, **env: str) -> str:
    env = {"MMFEAT_RUNTIME_DIR": str(d.runtime_dir), "FAKE_CUDA_SCENARIO_NUMEL": str(NUMEL), **env}
    return fake_cuda.run(fake_libcuda, tmp_path / "staged.log", "staged_get_by_key_under_pressure", env)


def _quiet(d: Daemon) -> dict:
    """The daemon's books once no hold and no reserved lease is left."""
    return d.wait_for(lambda s: s["holds"] == 0 and s["leases"]["RESERVED"] == 0, timeout=30,
                      what="no hold and no reserved lease")


def test_a_staged_get_by_key_of_an_unheld_retained_feature_keeps_it_until_its_copy_ran(
        fake_libcuda, host_daemon, tmp_path) -> None:
    key, other = NS.key("retained"), NS.key("other")
    with Client(host_daemon.runtime_dir, fallback="error") as producer:
        producer.put(torch.full((NUMEL,), 7.0), key=key, retain_ttl=300.0)
        log = _run(fake_libcuda, tmp_path, host_daemon, FAKE_CUDA_SCENARIO_KEY=key, FAKE_CUDA_SCENARIO_VALUE="7",
                   FAKE_CUDA_SCENARIO_OTHER=other)
        assert "=== the copy holds the feature's bytes: True" in log, log
        # The copy's hold kept the feature from the other put, which the pool could then not take.
        assert "=== the other put went: inline" in log, log
        assert "!!" not in log, log
        # The hold ended behind the copy: the feature is nothing's now, and the pool's need evicts it.
        s = _quiet(host_daemon)
        assert s["counters"]["holds"] == 1
        assert not producer.put(torch.full((NUMEL,), 1.0), key=other, retain_ttl=300.0).is_inline
        assert not producer.has(key)


def test_a_staged_get_by_key_of_a_counted_feature_acked_meanwhile_raises_or_reads_its_bytes(
        fake_libcuda, host_daemon, tmp_path) -> None:
    key, other = NS.key("counted"), NS.key("other")
    with Client(host_daemon.runtime_dir, fallback="error") as producer:
        desc = producer.put(torch.full((NUMEL,), 7.0), key=key)
        log = _run(fake_libcuda, tmp_path, host_daemon, FAKE_CUDA_SCENARIO_KEY=key, FAKE_CUDA_SCENARIO_VALUE="7",
                   FAKE_CUDA_SCENARIO_OTHER=other, FAKE_CUDA_SCENARIO_ACK=desc.to_bytes().hex())
        # Its consumer's ack freed it, and the other put took its space before the copy ran.
        assert "=== the other put went: pool" in log, log
        assert ("=== the get raised STALE" in log or "=== the get raised NOT_FOUND" in log
                or "=== the copy holds the feature's bytes: True" in log), log
        assert "=== the copy holds the feature's bytes: False" not in log, log
        assert "!!" not in log, log
        _quiet(host_daemon)
