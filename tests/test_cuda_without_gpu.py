"""The CUDA paths on a machine without a GPU: they import, say what is missing, and never pretend."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from mmfeat import cuda_driver as drv
from mmfeat.client.policy import (
    Topology,
    TransportConfigError,
    resolve_transport,
    supports_cuda_vmm_feature_transport,
)

no_driver = pytest.mark.skipif(drv.driver_unavailable_reason() is None, reason="a CUDA driver is present here")


def test_cuda_modules_import() -> None:
    import mmfeat.client.gpu.cuda_import  # noqa: F401
    import mmfeat.daemon.pools.cuda_vmm  # noqa: F401
    import mmfeat.daemon.pools.fabric_probe  # noqa: F401


@no_driver
def test_backend_reports_why_it_is_unavailable() -> None:
    from mmfeat.daemon.pools.cuda_vmm import cuda_unavailable_reason

    reason = cuda_unavailable_reason([0])
    assert reason and ("libcuda" in reason or "driver" in reason)


@no_driver
def test_fabric_probe_gives_a_clean_verdict() -> None:
    from mmfeat.daemon.pools.fabric_probe import probe_fabric

    verdict = probe_fabric(0)
    assert verdict.ok is False and verdict.reason


@no_driver
def test_auto_backend_picks_host_and_says_why(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "16", "--backend", "auto")
    pool = d.pool()
    assert pool["kind"] == "host" and pool["handle"] == "posix_fd"
    d.stop()
    _, err = d.proc.communicate()
    assert "backend auto chose host memory" in err and "driver" in err


@no_driver
def test_explicit_cuda_vmm_backend_exits_with_the_reason(runtime_dir) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mmfeat.daemon", "--runtime-dir", str(runtime_dir), "--backend", "cuda_vmm"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 1
    assert "backend cuda_vmm cannot work here" in r.stderr and "driver" in r.stderr
    assert not (runtime_dir / "mmfeatd.sock").exists()


# --- the transport policy, every branch, with injected topologies -----------------------------------

SINGLE = Topology(cuda=True, nnodes=1, mnnvl_fabric=False, imex_channel=False)
MNNVL = Topology(cuda=True, nnodes=2, mnnvl_fabric=True, imex_channel=True)
MNNVL_NO_IMEX = Topology(cuda=True, nnodes=2, mnnvl_fabric=True, imex_channel=False)
MULTI_PLAIN = Topology(cuda=True, nnodes=4, mnnvl_fabric=False, imex_channel=False)
NO_CUDA = Topology(cuda=False, nnodes=1, mnnvl_fabric=False, imex_channel=False)


class KimiK25:
    supports_cuda_vmm_feature_transport = True


class TextOnly:
    pass


@pytest.fixture(autouse=True)
def _fresh_policy_log():
    from mmfeat.client import policy

    policy.forget_logged()


def _resolve(caplog, requested, topo, model):
    with caplog.at_level(logging.INFO, logger="mmfeat.policy"):
        d = resolve_transport(requested, topo, supports_cuda_vmm_feature_transport(model))
    return d, " ".join(r.message for r in caplog.records)


def test_opt_in_contract() -> None:
    assert supports_cuda_vmm_feature_transport(KimiK25) and not supports_cuda_vmm_feature_transport(TextOnly)


def test_supported_model_on_multinode_mnnvl_gets_fabric(caplog) -> None:
    d, logs = _resolve(caplog, "auto", MNNVL, KimiK25)
    assert (d.transport, d.handle) == ("pool", "fabric")
    assert "multi-node GB200/GB300 MNNVL" in logs and "opt out" in logs


def test_unsupported_model_on_mnnvl_goes_inline(caplog) -> None:
    d, logs = _resolve(caplog, "auto", MNNVL, TextOnly)
    assert (d.transport, d.handle) == ("inline", None)
    assert "has not opted into CUDA VMM transport" in logs


def test_mnnvl_without_imex_channel_goes_inline_with_the_fix(caplog) -> None:
    d, logs = _resolve(caplog, "auto", MNNVL_NO_IMEX, KimiK25)
    assert d.transport == "inline"
    assert "no IMEX channel is mounted" in logs and "Configure the MNNVL compute domain" in logs


def test_multinode_without_mnnvl_goes_inline(caplog) -> None:
    d, logs = _resolve(caplog, "auto", MULTI_PLAIN, KimiK25)
    assert d.transport == "inline" and "without an MNNVL fabric" in logs


def test_single_node_auto_is_pool_posix_fd(caplog) -> None:
    d, logs = _resolve(caplog, "auto", SINGLE, TextOnly)
    assert (d.transport, d.handle) == ("pool", "posix_fd") and "single-node CUDA" in logs


def test_cpu_requested_and_no_cuda_go_inline(caplog) -> None:
    assert resolve_transport("cpu", MNNVL, True).transport == "inline"
    d, logs = _resolve(caplog, "auto", NO_CUDA, KimiK25)
    assert d.transport == "inline" and "no CUDA device" in logs


def test_explicit_cuda_vmm_is_validated_never_silently_downgraded() -> None:
    assert resolve_transport("cuda_vmm", SINGLE, False).handle == "posix_fd"
    assert resolve_transport("cuda_vmm", MNNVL, False).handle == "fabric"
    for topo, needle in ((NO_CUDA, "needs a CUDA device"), (MNNVL_NO_IMEX, "IMEX channel"), (MULTI_PLAIN, "MNNVL")):
        with pytest.raises(TransportConfigError, match=needle) as info:
            resolve_transport("cuda_vmm", topo, True)
        assert isinstance(info.value, ValueError)
    with pytest.raises(TransportConfigError, match="unknown transport"):
        resolve_transport("cuda_ipc", SINGLE, True)


def test_decision_logged_once(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="mmfeat.policy"):
        for _ in range(5):
            resolve_transport("auto", SINGLE, False)
    assert len(caplog.records) == 1


def test_daemon_never_imports_torch() -> None:
    code = (
        "import sys, mmfeat.daemon.main, mmfeat.daemon.pools.cuda_vmm, mmfeat.daemon.metrics\n"
        "assert 'torch' not in sys.modules, 'the daemon imported torch'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def _driver_names_used() -> set[str]:
    """Every ``cu.<name>[.<member>]`` the CUDA modules reference, read from their source."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    files = ["mmfeat_pkg/cuda_driver.py", "client/gpu/cuda_import.py", "daemon/pools/cuda_vmm.py",
             "daemon/pools/fabric_probe.py"]
    names: set[str] = set()
    for f in files:
        names |= set(re.findall(r"\bcu\.([A-Za-z_]+(?:\.[A-Za-z_]+)*)", (root / f).read_text()))
    return names


@pytest.mark.skipif(drv.cu is None, reason="cuda-python is not installed")
def test_every_driver_name_the_cuda_paths_use_exists() -> None:
    """The CUDA paths cannot run here; at least every entry point, enum member and struct they use must
    exist in the installed bindings, so a typo fails in CI rather than on the first GPU node."""
    names = _driver_names_used()
    assert len(names) > 20
    for dotted in sorted(names):
        obj = drv.cu
        for part in dotted.split("."):
            assert hasattr(obj, part), f"cuda.bindings.driver has no {dotted}"
            obj = getattr(obj, part)
    for attr in ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
        assert hasattr(drv.cu.CUdevice_attribute, attr)
    # The structs take the fields we set, and the two handle types map as documented.
    prop = drv.allocation_prop(3, "fabric")
    assert prop.location.id == 3 and int(prop.requestedHandleTypes) == 8
    assert int(drv.allocation_prop(0, "posix_fd").requestedHandleTypes) == 1
    desc = drv.access_desc(2)
    assert desc.location.id == 2 and desc.flags == drv.cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert drv.access_desc(2, readonly=True).flags == drv.cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ


def test_every_nvml_name_the_fabric_checks_use_exists() -> None:
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByIndex",
                 "nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t", "NVML_GPU_FABRIC_STATE_COMPLETED"):
        assert hasattr(pynvml, name), name
    info = pynvml.c_nvmlGpuFabricInfoV_t()
    assert len(bytes(info.clusterUuid)) == 16 and int(info.state) == 0 and int(info.cliqueId) == 0
    assert pynvml.NVML_GPU_FABRIC_STATE_COMPLETED == 3  # cuda_driver.fabric_domain compares with 3


def test_dlpack_view_has_no_copy_and_keeps_its_owner_until_the_last_view() -> None:
    """The path GPU pools take, exercised on host memory: same code, DLPack device kDLCPU."""
    import ctypes
    import gc
    import mmap

    import torch

    from mmfeat.client.gpu import dlpack

    released = []

    class Owner:
        def __del__(self) -> None:
            released.append(True)

    mm = mmap.mmap(-1, 1 << 16)
    ptr = ctypes.addressof((ctypes.c_uint8 * (1 << 16)).from_buffer(mm))
    before = dlpack.live_capsules()
    t = dlpack.uint8_tensor(ptr, 1 << 16, dlpack.KDL_CPU, 0, Owner())
    assert t.data_ptr() == ptr and t.dtype == torch.uint8 and t.shape == (1 << 16,)
    t[100] = 42
    assert mm[100] == 42  # a view, not a copy
    view = t[64:128].view(torch.float32)
    del t
    gc.collect()
    assert not released, "the owner (the mapping) went while a view still used it"
    del view
    gc.collect()
    assert released and dlpack.live_capsules() == before


def test_keep_alive_views_the_same_bytes_and_holds_its_owner_until_the_last_view() -> None:
    import gc

    import torch

    from mmfeat.client.gpu import dlpack

    released = []

    class Owner:
        def __del__(self) -> None:
            released.append(True)

    pool = torch.arange(4096, dtype=torch.int32)
    for t in (pool[8:1032].view(4, 256).t(), pool[16:32].view(torch.float32), pool[:64].view(torch.bool)[1::3]):
        released.clear()
        held = dlpack.keep_alive(t, Owner())
        assert held.data_ptr() == t.data_ptr() and held.stride() == t.stride() and held.dtype == t.dtype
        assert torch.equal(held, t) if t.dtype != torch.float32 else torch.equal(held.view(torch.int32), pool[16:32])
        part = held[:2]
        del held
        gc.collect()
        assert not released, "the owner went while a view of the tensor still used it"
        del part
        gc.collect()
        assert released
    empty = torch.empty(0, 3)
    assert dlpack.keep_alive(empty, Owner()) is empty


def test_a_view_alive_at_interpreter_exit_does_not_crash_it() -> None:
    """A consumer on a GPU must not die of SIGSEGV at exit: Python can free a DLPack struct held in a
    module dict before a tensor that points at it, and torch's deleter call would read freed memory.
    Here a tensor is parked in torch's own module, which exit clears after ours."""
    import subprocess
    import sys

    code = (
        "import ctypes, mmap, os, torch\n"
        "from mmfeat.client.gpu import dlpack\n"
        "mm = mmap.mmap(-1, 1 << 16)\n"
        "ptr = ctypes.addressof((ctypes.c_uint8 * (1 << 16)).from_buffer(mm))\n"
        "class Owner:\n"
        "    def __del__(self):\n"
        "        os.write(1, b'owner released\\n')\n"
        "torch._mmfeat_parked = dlpack.uint8_tensor(ptr, 1 << 16, dlpack.KDL_CPU, 0, Owner())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit status {r.returncode}: {r.stderr}"  # -11 every time before the fix
    assert "Exception ignored" not in r.stderr, r.stderr


def test_any_openable_imex_channel_counts(tmp_path) -> None:
    assert drv.imex_channel_present(tmp_path / "absent")[0] is False
    channels = tmp_path / "nvidia-caps-imex-channels"
    channels.mkdir()
    assert drv.imex_channel_present(channels)[0] is False
    (channels / "channel7").write_text("")  # a ComputeDomain may hand a pod channel 7, not channel0
    ok, why = drv.imex_channel_present(channels)
    assert ok and "channel7" in why


def test_the_acker_sleeps_on_the_event_and_acks_when_it_wakes() -> None:
    import threading
    import time

    from mmfeat.client.consume.ack_thread import Acker
    from mmfeat.client.link.async_failures import AsyncFailures

    class GpuWork:  # what ack(after=) hands the acker: a fence of blocking events (client/gpu/gpu_order.py)
        lane = (0, 7)

        def __init__(self) -> None:
            self.done = threading.Event()
            self.queries = 0

        def wait(self) -> None:
            self.done.wait(30)

        def query(self) -> bool:
            self.queries += 1
            return self.done.is_set()

    sent: list[int] = []
    acker = Acker(lambda fields, count, ack_id: sent.append(count), lambda timeout: True, AsyncFailures())
    work = GpuWork()
    try:
        acker.submit({"lease": {"lease": 1}}, 2, b"\0" * 8, work)
        time.sleep(0.2)
        assert not sent, "acked before the GPU work was done"
        work.done.set()
        assert acker.flush(30.0)
        # Slept in wait() and acked when it returned: polling would add its sleep to the delay.
        assert sent == [2] and work.queries == 0, work.queries
    finally:
        work.done.set()
        acker.close(5.0)


def test_gpu_pools_are_matched_by_uuid_not_ordinal() -> None:
    # An older daemon without uuids: its ordinal stands. A uuid no local GPU has: not visible here.
    assert drv.local_ordinal({"device": 3}) == 3
    assert drv.local_ordinal({"device": 3, "uuid": "GPU-00000000-0000-0000-0000-000000000000"}) is None


def test_the_gpu_suites_import_stage_runs_here() -> None:
    """tests/gpu/run.sh goes to a GPU node in one call: its import stage must not rot where CI can see it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (Path(__file__).parent / "gpu" / "run.sh").read_text()
    stage = script.split('stage "imports"\n', 1)[1].split('\nstage "', 1)[0]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", stage], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "libatomic (table acks):" in out.stdout and "driver:" in out.stdout


def test_cpu_features_go_to_the_host_pool_on_one_node_and_gpu_features_to_their_gpu() -> None:
    import dataclasses

    from mmfeat.client.policy import feature_pool
    from mmfeat.protos.messages import PoolInfo

    gpu = PoolInfo(pool=0, epoch=1, kind="cuda", device=0, size=1 << 20, handle="posix_fd", fabric=None, uuid="GPU-0")
    host = PoolInfo(pool=1, epoch=1, kind="host", device=-1, size=1 << 20, handle="posix_fd", fabric=None, uuid=None)
    assert feature_pool([gpu, host], None) is host  # made on the CPU: consumers stage it, the producer copies nothing
    assert feature_pool([gpu, host], gpu) is gpu  # already on a GPU: its pool
    assert feature_pool([gpu], None) is gpu  # no host pool: as before, into HBM
    assert feature_pool([host], None) is host
    fabric = dataclasses.replace(gpu, handle="fabric")
    assert feature_pool([fabric, host], None) is fabric  # across nodes other nodes map the FABRIC pool


def test_only_a_host_pool_feature_for_a_gpu_is_staged_asynchronously() -> None:
    from mmfeat.client.policy import feature_staging

    for device in (0, 3, "cuda", "cuda:1", torch.device("cuda", 2)):
        assert feature_staging("host", device) == "pinned_async", device
    for kind, device in (("host", None), ("host", "cpu"), ("host", torch.device("cpu")), ("cuda", 0),
                         ("cuda", "cuda:0")):
        assert feature_staging(kind, device) == "sync", (kind, device)
