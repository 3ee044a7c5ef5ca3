"""The GPU path against a logging stand-in for the CUDA driver (tests/fake_cuda): what the daemon and the
client ask of the driver, call by call, on a machine without a GPU. Skipped, saying why, where the stand-in
cannot be built or loaded."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mmfeat.protos.descriptor import Descriptor

from . import fake_cuda, workers
from .conftest import start_daemon


def _run(fake_libcuda: Path, tmp_path: Path, scenario: str, **env: str) -> str:
    return fake_cuda.run(fake_libcuda, tmp_path / f"{scenario}.log", scenario, env)


def _calls_with_context(log: str, call: str) -> list[str]:
    """The context current at each call to ``call`` (the line the fake writes after it)."""
    return re.findall(rf"^{call}\(.*\n    \[current ctx (\S+)\]", log, re.M)


def test_a_failed_wrap_after_the_mapping_releases_the_context_exactly_once(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "wrap_fails")
    assert "=== map_cuda_pool raised: torch refused the capsule" in log
    retains = len(re.findall(r"^cuDevicePrimaryCtxRetain\(dev=0\)", log, re.M))
    releases = len(re.findall(r"^cuDevicePrimaryCtxRelease\(dev=0\)", log, re.M))
    assert retains == releases + 1, f"{retains} retains, {releases} releases: the runtime's own reference is gone"
    assert "DESTROYED" not in log, "the context the runtime still uses was destroyed"
    assert log.count("cuMemUnmap(") == 1 and log.count("cuMemAddressFree(") == 1, "the mapped range leaked"


def test_the_daemon_tears_each_pool_down_in_its_own_context(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "daemon_two_pools")
    for pool, ctx in ((0, "0x1000"), (1, "0x1001")):
        teardown = fake_cuda.section(log, f"close pool {pool}", f"close pool {pool + 1}" if pool == 0 else "end")
        for call in ("cuCtxSynchronize", "cuMemUnmap", "cuMemRelease"):
            assert _calls_with_context(teardown, call) == [ctx], f"pool {pool}'s {call}:\n{teardown}"
        assert f"cuDevicePrimaryCtxRelease(dev={pool}) refs=0  ** DESTROYED" in teardown
    assert "destroyed ctx still current" not in log


def test_unmapping_creates_no_context_on_a_gpu_this_process_never_used(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "owner_never_used")
    assert re.search(r"^cuMemSetAccess\(.*dev=1, ", log, re.M), "the pool's own GPU was not granted access"
    drop = fake_cuda.section(log, "drop the mapping", "end")
    assert "primary ctx dev 1 CREATED" not in log, "the unmap made a context on GPU 1"
    assert not re.search(r"^cuDevicePrimaryCtxRetain\(dev=1\)", log, re.M)
    assert _calls_with_context(drop, "cuCtxSynchronize") == ["0x1000"], drop  # the GPU it used is waited for
    assert _calls_with_context(drop, "cuMemUnmap") == ["0x1000"], drop


def test_mapping_and_unmapping_give_the_thread_back_its_current_context(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "restore_current")
    for case, ctx in (("none current", "0x0"), ("runtime's current", "0x1000")):
        for when in ("before", "after map", "after unmap"):
            assert f"=== {case}: {when} {ctx}\n" in log, f"{case}, {when}:\n{log}"
    # The VMM calls themselves ran with the mapping's context current.
    assert set(_calls_with_context(log, "cuMemMap")) == {"0x1000"}


def test_pools_ask_for_gpudirect_rdma_where_the_device_supports_it(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "daemon_two_pools", STUB_NO_RDMA_DEV="1")
    assert re.search(r"^cuMemCreate\(.*dev=0, gpuDirectRDMACapable=1\)", log, re.M), log
    assert re.search(r"^cuMemCreate\(.*dev=1, gpuDirectRDMACapable=0\)", log, re.M), log
    assert "=== pool 0 on GPU 0: gpu_direct_rdma=True" in log and "=== pool 1 on GPU 1: gpu_direct_rdma=False" in log


@pytest.mark.parametrize("ordering", ["0", "100", "200"], ids=["none", "owner", "all devices"])
def test_pulled_bytes_are_flushed_to_every_gpu_unless_the_device_orders_them(fake_libcuda, tmp_path,
                                                                             ordering) -> None:
    """A NIC's GPUDirect RDMA writes into a pool are visible to kernels on every GPU only where the device
    orders them for all (GPU_DIRECT_RDMA_WRITES_ORDERING = ALL_DEVICES): elsewhere each pulled feature is
    flushed to all devices, in the pool's context, before it is handed out. A pool no NIC can write
    (not RDMA capable) needs none."""
    log = _run(fake_libcuda, tmp_path, "daemon_two_pools", STUB_NO_RDMA_DEV="1", STUB_RDMA_ORDERING=ordering)
    pulls = fake_cuda.section(log, "pulled into pool 0, 0", "close pool 0")
    flushes = _calls_with_context(pulls, "cuFlushGPUDirectRDMAWrites")
    if ordering == "200":
        assert flushes == [], pulls
    else:
        assert flushes == ["0x1000", "0x1000"], pulls  # pool 0's context, once a pull; none for pool 1
        assert "cuFlushGPUDirectRDMAWrites(target=0, scope=200)" in pulls
    assert len(re.findall(r"^cuDeviceGetAttribute\(attr=118, dev=0\)", log, re.M)) == 1  # asked once


def test_stats_say_which_gpu_pools_are_rdma_capable(fake_libcuda, runtime_dir, tmp_path) -> None:
    env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(tmp_path / "daemon.log"), "STUB_NO_RDMA_DEV": "1"}
    d = start_daemon(runtime_dir, "--devices", "0,1", "--pool-mb", "16", backend="cuda_vmm", env=env)
    try:
        pools = {p["device"]: p for p in d.stats()["pools"]}
    finally:
        rc = d.stop()
        _, err = d.proc.communicate()
    assert rc == 0, err
    assert [(pools[i]["kind"], pools[i]["gpu_direct_rdma"]) for i in (0, 1)] == [("cuda", True), ("cuda", False)]


def test_a_pool_that_failed_to_map_is_not_imported_again_until_the_retry(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "map_failure_remembered", STUB_IMPORT_FAIL_TYPE="1")
    first, later = log.split("=== after the wait\n", 1)
    assert first.count("cuMemImportFromShareableHandle(") == 1, first
    assert "=== put 0: CudaError: cuMemImportFromShareableHandle failed" in first
    for i in (1, 2):
        assert re.search(rf"=== put {i}: PoolMapError: GPU pool 0 failed to map on device 0 \(.*\); tried again", first)
    assert "=== fds left open: 0; import failures: 1" in first
    assert later.count("cuMemImportFromShareableHandle(") == 1 and "=== import failures: 2" in later
    # Each failed attempt gave back its context reference.
    retains, releases = (len(re.findall(rf"^cuDevicePrimaryCtx{c}", log, re.M)) for c in ("Retain", "Release"))
    assert retains == releases


def test_a_remembered_map_failure_keeps_nothing_of_the_put_that_met_it(fake_libcuda, tmp_path) -> None:
    """A failure is remembered for MAP_RETRY_S, and it must not hold the frames it went through: they hold
    the put's tensor (GPU memory of the user's), its Client and session, for as long as the pool fails."""
    log = _run(fake_libcuda, tmp_path, "failed_map_holds_nothing", STUB_IMPORT_FAIL_TYPE="1")
    assert "=== put 0: the feature is freed: True" in log and "=== put 1: the feature is freed: True" in log, log


def test_a_host_pool_is_pinned_once_per_mapping_and_unpinned_once_after_its_last_view(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "pin_host_pool")
    addr = re.search(r"=== mapped at (0x[0-9a-f]+)", log).group(1)
    assert "=== gets: 3 pinned, same tensor: True" in log, log
    registers = re.findall(r"^cuMemHostRegister\((0x[0-9a-f]+), size=(\d+), flags=(\d+)\)", log, re.M)
    assert registers == [(addr, str(4 << 20), "1")], log  # the whole mapping, PORTABLE, once for all three gets
    assert _calls_with_context(log, "cuMemHostRegister") == ["0x1000"]
    assert f"=== view at {int(addr, 16) + 4096:#x}, cpu" in log
    alive, gone = log.split("=== mapping dropped; drop the view\n", 1)
    assert "cuMemHostUnregister" not in alive, "unpinned while a view of the pages was alive"
    assert re.findall(r"^cuMemHostUnregister\((0x[0-9a-f]+)\)", gone, re.M) == [addr], log
    assert _calls_with_context(log, "cuMemHostUnregister") == ["0x1000"]
    assert 0 <= gone.find("cuCtxSynchronize()") < gone.find("cuMemHostUnregister("), "a DMA may still read the pages"
    # The registration's context reference is given back; the consumer's own stays.
    retains, releases = (len(re.findall(rf"^cuDevicePrimaryCtx{c}\(dev=0\)", log, re.M)) for c in ("Retain", "Release"))
    assert retains == releases + 1 and "DESTROYED" not in log


def test_a_read_only_host_pool_is_pinned_read_only(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "pin_host_pool", FAKE_CUDA_SCENARIO_READONLY="1")
    assert re.findall(r"^cuMemHostRegister\(.*flags=(\d+)\)", log, re.M) == ["9"], log  # PORTABLE | READ_ONLY
    assert len(re.findall(r"^cuMemHostUnregister\(", log, re.M)) == 1


def test_a_host_pool_that_cannot_be_pinned_is_asked_once(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "pin_host_pool", STUB_HOSTREGISTER_FAIL="1")
    assert "=== gets: 0 pinned" in log and len(re.findall(r"^cuMemHostRegister\(", log, re.M)) == 1, log
    assert "cuMemHostUnregister" not in log
    retains, releases = (len(re.findall(rf"^cuDevicePrimaryCtx{c}\(dev=0\)", log, re.M)) for c in ("Retain", "Release"))
    assert retains == releases + 1


def test_cpu_features_go_to_the_host_pool_beside_the_gpu_pools(fake_libcuda, runtime_dir, tmp_path, children) -> None:
    """A producer's CPU tensors land in the daemon's host pool (host_pool_mb), not in HBM, and a consumer
    in another process reads every byte; the GPU pool stays untouched."""
    env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(tmp_path / "daemon.log")}
    d = start_daemon(runtime_dir, "--devices", "0", "--pool-mb", "16", "--host-pool-mb", "160", backend="cuda_vmm",
                     env=env)
    try:
        assert [(p["kind"], p["pool"]) for p in d.stats()["pools"]] == [("cuda", 0), ("host", 1)]
        q_prod, q_cons, results = children.Queue(), children.Queue(), children.Queue()
        producer = children.Process(target=workers.produce, args=(str(runtime_dir), 1, q_prod))
        consumer = children.Process(target=workers.consume, args=(str(runtime_dir), q_cons, results, False))
        producer.start()
        consumer.start()
        kinds = set()
        while (item := q_prod.get(timeout=120)) is not None:
            desc = Descriptor.from_bytes(item[-1])
            kinds.add((desc.kind, desc.pool))
            q_cons.put(item)
        q_cons.put(None)
        out = results.get(timeout=120)
        producer.join(30)
        consumer.join(30)
        assert out[0] == "ok", out
        assert kinds == {("host", 1)}
        stats = d.wait_for(lambda s: sum(s["leases"].values()) == 0, timeout=20, what="every feature acked")
        assert [p["used"] for p in stats["pools"]] == [0, 0]
    finally:
        rc = d.stop()
        _, err = d.proc.communicate()
    assert rc == 0, err


def test_a_process_without_cuda_puts_and_reserves_inline_where_the_daemon_has_only_gpu_pools(
        fake_libcuda, runtime_dir, tmp_path) -> None:
    """host_pool_mb 0: a CPU tensor's feature goes to the GPU pool. A producer whose torch sees no CUDA
    device (a CPU-only build, or no device visible) cannot map it: put and reserve fall back inline,
    counted as map_failed, and a get of a GPU-pool feature raises a typed error, never torch's own."""
    import torch

    from mmfeat.client import Client
    from mmfeat.client.gpu.cuda_import import PoolMapError

    if torch.cuda.is_available():
        pytest.skip("this process sees a CUDA device")
    env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(tmp_path / "daemon.log")}
    d = start_daemon(runtime_dir, "--devices", "0", "--pool-mb", "16", backend="cuda_vmm", env=env)
    try:
        assert [p["kind"] for p in d.stats()["pools"]] == ["cuda"]
        with Client(runtime_dir, inline_threshold=0) as c:
            x = torch.arange(1024, dtype=torch.float32)
            desc = c.put(x)
            assert desc.is_inline and torch.equal(c.get(desc), x)
            t = c.reserve((1024,), torch.float32)
            t.copy_(x + 1)
            assert c.publish(t).is_inline
            assert c.fallbacks["map_failed"] == 2
            session = c._connect()
            lease = c.request("reserve", session=session.token, nbytes=4096, consumers=1)["lease"]
            in_gpu_pool = dataclasses.replace(desc, kind="cuda", device=0, node=session.node, epoch=session.epoch,
                                              inline=None, **{k: lease[k] for k in ("pool", "lease", "gen",
                                                                                    "token", "offset")})
            with pytest.raises(PoolMapError, match="no CUDA device"):
                c.get(in_gpu_pool)
            c.request("release", session=session.token, lease=lease)
        assert d.stats()["counters"]["reserves"] == 1 and d.pool()["used"] == 0
    finally:
        rc = d.stop()
        _, err = d.proc.communicate()
    assert rc == 0, err


def test_a_fabric_handle_of_the_wrong_length_is_refused_before_the_driver_reads_it(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "short_fabric_handle")
    assert "=== PoolMapError: GPU pool 0's FABRIC handle is 10 bytes, not 64" in log, log
    assert "cuMemImportFromShareableHandle" not in log, "the driver was handed a short buffer"


def test_a_host_pool_pinned_for_two_gpus_waits_for_both_before_it_is_unpinned(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "pin_two_devices")
    assert "=== pinned: 2" in log, log
    gone = fake_cuda.section(log, "drop the mapping", "end")
    unregister = gone.find("cuMemHostUnregister(")
    synced = _calls_with_context(gone[:unregister], "cuCtxSynchronize")
    assert unregister > 0 and set(synced) == {"0x1000", "0x1001"}, f"a copy to a GPU may still read the pages:\n{gone}"


def test_a_forked_child_dropping_a_pinned_host_pool_leaves_the_registration_to_the_parent(
        fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "child_drops_pinned_pool")
    child = fake_cuda.section(log, "the child drops its copy", "the child dropped it")
    assert "cuMemHostUnregister" not in child and "cuCtxSynchronize" not in child, child
    parent = fake_cuda.section(log, "the parent drops it", "end")
    assert parent.count("cuMemHostUnregister(") == 1, log


def test_the_fabric_probe_asks_nvml_before_it_makes_a_context(fake_libcuda, tmp_path) -> None:
    log = _run(fake_libcuda, tmp_path, "fabric_probe_without_nvml")
    assert "=== verdict: NVML: no fabric on this node" in log, log
    assert "cuDevicePrimaryCtxRetain" not in log, "a context was made for a verdict NVML alone gave"
