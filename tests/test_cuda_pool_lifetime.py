"""How long a GPU pool stays imported and mapped in a consumer, on the logging stand-in for the CUDA
driver (tests/fake_cuda): while a session uses it or a tensor views it, and not after, so a consumer that
outlives its daemon does not keep that daemon's HBM allocated."""

from __future__ import annotations

import re

from . import fake_cuda
from .conftest import start_daemon
from .test_fabric_route import _feature


def test_a_gpu_pool_is_unmapped_once_its_client_closed_and_its_last_view_is_gone(
        fake_libcuda, runtime_dir, tmp_path) -> None:
    """Two gets of the daemon's GPU pool import it once; closing the client leaves it mapped while a view
    lives (a new client's get finds it, without importing it again); dropping that view unmaps it and
    frees its address range, without a garbage collection."""
    env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(tmp_path / "daemon.log")}
    d = start_daemon(runtime_dir, "--devices", "0", "--pool-mb", "16", backend="cuda_vmm", env=env)
    try:
        log = fake_cuda.run(fake_libcuda, tmp_path / "consumer.log", "pool_lifetime",
                            {"MMFEAT_RUNTIME_DIR": str(runtime_dir),
                             "FAKE_CUDA_SCENARIO_DESC": _feature(d).to_bytes().hex()})
        d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the feature to be freed")
    finally:
        rc = d.stop()
        _, err = d.proc.communicate()
    assert rc == 0, err
    assert "=== two gets, one pool: True" in log and "=== a new client's get, same pool: True" in log, log
    assert len(re.findall(r"^cuMemImportFromShareableHandle\(", log, re.M)) == 1, log
    alive = fake_cuda.section(log, "client closed; a view lives", "drop the view")
    assert "cuMemUnmap(" not in alive and "cuMemAddressFree(" not in alive, f"unmapped under a live view:\n{alive}"
    gone = fake_cuda.section(log, "drop the view", "end")
    assert gone.count("cuMemUnmap(") == 1 and gone.count("cuMemAddressFree(") == 1, f"still mapped:\n{log}"
    # The mapping's context reference is given back; the consumer's own stays.
    retains, releases = (len(re.findall(rf"^cuDevicePrimaryCtx{c}\(dev=0\)", log, re.M)) for c in ("Retain", "Release"))
    assert retains == releases + 1 and "DESTROYED" not in log, log


def test_a_child_forked_while_a_thread_imports_a_gpu_pool_maps_its_own(fake_libcuda, tmp_path) -> None:
    """A thread of the parent inside map_cuda_pool at the fork holds the GPU pool cache's lock; the
    child's own import takes it fresh instead of waiting for it forever."""
    log = fake_cuda.run(fake_libcuda, tmp_path / "fork.log", "fork_while_importing")
    assert "=== child exited 0" in log, log


def test_a_forked_child_dropping_its_parents_gpu_pool_leaves_the_mapping_to_the_parent(fake_libcuda, tmp_path) -> None:
    """A child inherits the parent's mapped range; dropping its copy makes no driver call (the range and
    the context reference are the parent's), and the parent unmaps it once, when it drops its own."""
    log = fake_cuda.run(fake_libcuda, tmp_path / "child.log", "child_drops_parents_pool")
    child = fake_cuda.section(log, "the child drops its copy", "the child dropped it")
    assert "cuMemUnmap(" not in child and "cuDevicePrimaryCtxRelease(" not in child, child
    parent = fake_cuda.section(log, "the parent drops the pool", "end")
    assert parent.count("cuMemUnmap(") == 1 and parent.count("cuMemAddressFree(") == 1, log


def test_a_gpu_pool_mapped_again_while_another_thread_unmaps_it_is_imported_anew(fake_libcuda, tmp_path) -> None:
    """The cache must not hand out a range that is being unmapped: while a thread drops the last reference
    to a pool's range and the driver unmaps it, a map of the same pool in another thread imports it again
    and gets a live range. The range's weak reference in the cache outlived the range's own __del__,
    which ran the unmap: the second map found the dying range and raised TypeError (its address already
    None), or, a few bytecodes earlier, would have taken a view of memory about to be unmapped."""
    log = fake_cuda.run(fake_libcuda, tmp_path / "remap.log", "remap_while_unmapping", {"STUB_UNMAP_SLEEP_MS": "1000"})
    assert "=== mapped again while unmapping: mapped: True" in log, log
    assert len(re.findall(r"^cuMemImportFromShareableHandle\(", log, re.M)) == 2, log
    assert log.count("cuMemUnmap(") == 2 and log.count("cuMemAddressFree(") == 2, log
