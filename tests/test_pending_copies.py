"""The consumer's book of staged copies in flight (client/consume/pinned.py, PendingCopies) stays within its
bound, and forgets no copy before it has completed: an ack that finds nothing to wait for frees bytes
at once, and a DMA may still be reading them. With the real fences a staged get records
(client/gpu/gpu_order.py), on the fake driver's streams (tests/fake_cuda), which hold a copy back until
the kernel before it is released, against a real mmfeatd."""

from __future__ import annotations

from pathlib import Path


from . import fake_cuda
from .conftest import Daemon


def _run(fake_libcuda: Path, tmp_path: Path, d: Daemon, **env: str) -> str:
    log = fake_cuda.run(fake_libcuda, tmp_path / "pending.log", "staged_copies_past_the_bound",
                        {"MMFEAT_RUNTIME_DIR": str(d.runtime_dir), **env})
    assert "!!" not in log, log
    return log


def test_a_staged_get_past_the_bound_waits_for_the_oldest_copy_and_keeps_its_ack_behind_it(
        fake_libcuda, host_daemon, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, host_daemon)
    assert "=== the get past the bound waits for the oldest copy: True" in log, log
    assert "=== the get past the bound: ['returned']" in log, log
    assert "=== freed once the copy ran: True" in log, log
    assert "=== the second freed: True" in log, log


def test_a_staged_get_past_the_bound_gives_up_after_the_clients_timeout_and_keeps_the_copy(
        fake_libcuda, host_daemon, tmp_path) -> None:
    """A copy that does not run within the client's timeout (its stream stuck) is kept past the bound:
    the get returns, and the first feature's ack still waits for its copy."""
    log = _run(fake_libcuda, tmp_path, host_daemon, FAKE_CUDA_TIMEOUT="1")
    assert "=== the get past the bound: ['returned']; the first copy still queued: True" in log, log
    assert "=== the first feature acked with its copy queued; still live: True" in log, log
    assert "=== freed once the copy ran: True" in log, log
