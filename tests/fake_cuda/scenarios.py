"""Scenarios run in a child process against the fake libcuda (tests/fake_cuda/__init__.py); each leaves
its findings in the driver's log as ``=== `` marks.

    LD_LIBRARY_PATH=<fake> STUB_LOG=<log> python tests/fake_cuda/scenarios.py NAME
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent.parent))  # run by path: `tests` is importable

import torch  # noqa: E402

from mmfeat import cuda_driver as drv  # noqa: E402

LOG = os.environ["STUB_LOG"]


def mark(text: str) -> None:
    with open(LOG, "a") as f:
        f.write(f"=== {text}\n")


def current() -> int:
    return int(drv.ck("cuCtxGetCurrent", drv.cu.cuCtxGetCurrent()))


def runtime_context(ordinal: int) -> None:
    """What torch's runtime does on a device's first use: retain its primary context (and keep it)."""
    drv.ck("cuDevicePrimaryCtxRetain", drv.cu.cuDevicePrimaryCtxRetain(drv.device(ordinal)))


def fake_torch_cuda(device: int) -> None:
    """The little of torch.cuda the client calls, for torch's CPU build. A synchronize creates the
    device's context as the runtime would on a device this process never used."""
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: device
    torch.cuda.synchronize = lambda d=None: runtime_context(device if d is None else d)


def pool_info(owner_phys: int = 0, daemon_ordinal: int = 0) -> Any:
    from mmfeat.protos.messages import PoolInfo

    uuid = f"GPU-aa000000-0000-0000-0000-0000000000{owner_phys:02x}"
    return PoolInfo(pool=0, epoch=1, kind="cuda", device=daemon_ordinal, size=64 << 20, handle="posix_fd", fabric=None,
                    uuid=uuid)


def cpu_dlpack() -> None:
    """The client's own DLPack wrap, as kDLCPU: torch's CPU build cannot make a CUDA tensor. The memory
    is never touched."""
    from mmfeat.client.gpu import dlpack

    real = dlpack.uint8_tensor
    dlpack.uint8_tensor = lambda ptr, n, dt, did, owner: real(ptr, n, dlpack.KDL_CPU, 0, owner)


def wrap_fails() -> None:
    """The DLPack wrap fails after the range is mapped, while the runtime holds its own reference."""
    from mmfeat.client.gpu import cuda_import, dlpack

    fake_torch_cuda(0)
    runtime_context(0)
    mark("runtime holds one reference")

    def refuse(*args: object, **kw: object) -> None:
        raise RuntimeError("torch refused the capsule")

    dlpack.uint8_tensor = refuse
    try:
        cuda_import.map_cuda_pool("ep", pool_info(), os.memfd_create("pool"))
    except RuntimeError as exc:
        mark(f"map_cuda_pool raised: {exc}")
    gc.collect()
    mark("end")


def restore_current() -> None:
    """The context current on the calling thread before a mapping and after it, and after its unmap."""
    from mmfeat.client.gpu import cuda_import

    fake_torch_cuda(0)
    cpu_dlpack()
    runtime_context(0)
    for name, before in (("none current", None), ("runtime's current", 0)):
        ctx = drv.cu.CUcontext(0) if before is None else drv.cu.cuDevicePrimaryCtxRetain(drv.device(before))[1]
        if before is not None:
            drv.cu.cuDevicePrimaryCtxRelease(drv.device(before))  # only its handle was wanted
        drv.ck("cuCtxSetCurrent", drv.cu.cuCtxSetCurrent(ctx))
        mark(f"{name}: before {current():#x}")
        m = cuda_import.map_cuda_pool(name, pool_info(), os.memfd_create("pool"))
        mark(f"{name}: after map {current():#x}")
        cuda_import._cache.clear()
        del m
        gc.collect()
        mark(f"{name}: after unmap {current():#x}")
    mark("end")


def owner_never_used() -> None:
    """This process uses GPU 0; the pool lives on GPU 1, which it grants access to but never used."""
    from mmfeat.client.gpu import cuda_import

    fake_torch_cuda(0)
    cpu_dlpack()
    runtime_context(0)
    drv.ck("cuCtxSetCurrent", drv.cu.cuCtxSetCurrent(drv.cu.cuDevicePrimaryCtxRetain(drv.device(0))[1]))
    drv.cu.cuDevicePrimaryCtxRelease(drv.device(0))
    m = cuda_import.map_cuda_pool("ep", pool_info(owner_phys=1, daemon_ordinal=1), os.memfd_create("pool"))
    mark(f"mapped for device {m.device}")
    cuda_import._cache.clear()
    mark("drop the mapping")
    del m
    gc.collect()
    mark("end")


def daemon_two_pools() -> None:
    """The daemon's pools on GPUs 0 and 1, both mapped for NIXL, then closed one after the other."""
    from mmfeat.daemon.config import Settings
    from mmfeat.daemon.pools import cuda_vmm

    pools = cuda_vmm.create_cuda_pools(Settings(devices=[0, 1], nnodes=1, pool_mb=64))
    for p in pools:
        mark(f"pool {p.pool_id} on GPU {p.device}: gpu_direct_rdma={p.rdma}")
    for p in pools:
        p.map_for_pulls()
    for p in pools:
        for k in range(2):  # a NIC wrote two pulled features into it
            mark(f"pulled into pool {p.pool_id}, {k}")
            p.remote_writes_landed()
    for p in pools:
        mark(f"close pool {p.pool_id}")
        p.close()
    mark("end")


def map_failure_remembered() -> None:
    """An import that fails (STUB_IMPORT_FAIL_TYPE=1), asked for three times, then once after the wait."""
    from mmfeat.client.gpu import cuda_import

    fake_torch_cuda(0)
    cpu_dlpack()
    fds = []
    for i in range(3):
        fd = os.memfd_create("pool")
        fds.append(fd)
        try:
            cuda_import.map_cuda_pool("ep", pool_info(), fd)
        except RuntimeError as exc:
            mark(f"put {i}: {type(exc).__name__}: {exc}")
    open_fds = [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]
    mark(f"fds left open: {len(open_fds)}; import failures: {cuda_import.import_failures()}")
    cuda_import.MAP_RETRY_S = 0.0
    mark("after the wait")
    try:
        cuda_import.map_cuda_pool("ep", pool_info(), os.memfd_create("pool"))
    except RuntimeError as exc:
        mark(f"retry: {type(exc).__name__}")
    mark(f"import failures: {cuda_import.import_failures()}")


def failed_map_holds_nothing() -> None:
    """A put whose pool fails to map (STUB_IMPORT_FAIL_TYPE=1) falls back; what it was putting must go
    once the put is over, though the failure itself is remembered."""
    import weakref

    from mmfeat.client.gpu import cuda_import

    fake_torch_cuda(0)
    cpu_dlpack()

    class Feature:
        pass

    def put(feature: Feature) -> None:
        try:
            cuda_import.map_cuda_pool("ep", pool_info(), os.memfd_create("pool"))
        except RuntimeError:
            pass  # as the producer does: the feature goes inline

    for i in range(2):  # the failure, then the failure remembered
        feature = Feature()
        freed = weakref.ref(feature)
        put(feature)
        del feature
        gc.collect()
        mark(f"put {i}: the feature is freed: {freed() is None}")


def fabric_get() -> None:
    """A consumer on one node gets another node's feature ($FAKE_CUDA_SCENARIO_DESC, hex) through its own daemon
    ($MMFEAT_RUNTIME_DIR), which may relay the owner's FABRIC handle."""
    from mmfeat.client import Client
    from mmfeat.protos.errors import MmfeatError

    fake_torch_cuda(0)
    cpu_dlpack()
    with Client(timeout=20) as c:
        try:
            c.get(bytes.fromhex(os.environ["FAKE_CUDA_SCENARIO_DESC"]))
            mark("got the feature")
        except MmfeatError as exc:
            mark(f"get raised {exc.code.value}: {exc}")
        except Exception as exc:
            mark(f"get raised {type(exc).__name__}: {exc}")


def pin_host_pool() -> None:
    """A GPU consumer's staged gets from a host pool: the mapping pinned on the first, reused by the
    next ones, on devices 0 and 1; then the mapping dropped while a view of it lives, then the view.
    $FAKE_CUDA_SCENARIO_READONLY=1 maps the pool read-only."""
    from mmfeat.client.link import mapping as mapping_cache
    from mmfeat.client.consume.pinned import pinned_view

    fake_torch_cuda(0)
    runtime_context(0)  # the consumer's own use of its GPU
    readonly = os.environ.get("FAKE_CUDA_SCENARIO_READONLY") == "1"
    size = 4 << 20
    fd = os.memfd_create("pool")
    os.ftruncate(fd, size)
    m = mapping_cache.map_host_pool("ep", 0, 1, fd, size, readonly)
    mark(f"mapped at {m.tensor.data_ptr():#x}")
    views = [pinned_view(m, dev) for dev in (0, 0, 1)]
    mark(f"gets: {sum(v is not None for v in views)} pinned, same tensor: {views[0] is views[1] is views[2]}")
    keep = views[0][4096:8192] if views[0] is not None else None
    if keep is not None:
        mark(f"view at {keep.data_ptr():#x}, {keep.device}")
    del views
    mapping_cache._cache.clear()  # as a new daemon epoch does
    del m
    gc.collect()
    mark("mapping dropped; drop the view")
    del keep
    gc.collect()
    mark("end")


def pool_lifetime() -> None:
    """A consumer gets a feature of its daemon's GPU pool ($FAKE_CUDA_SCENARIO_DESC, hex) twice, closes
    its client while one view lives, gets it once more through another client, then drops the view; with
    garbage collection off but for one collection while the view lives."""
    from mmfeat.client import Client

    fake_torch_cuda(0)
    cpu_dlpack()
    runtime_context(0)  # the consumer's own use of its GPU
    gc.disable()  # what is unmapped must be unmapped by reference counting alone
    desc = bytes.fromhex(os.environ["FAKE_CUDA_SCENARIO_DESC"])
    c = Client(timeout=20)
    view = c.get(desc)
    again = c.get(desc)
    mark(f"two gets, one pool: {view.data_ptr() == again.data_ptr()}")
    del again
    c.ack(desc)
    c.close()
    mark("client closed; a view lives")
    with Client(timeout=20) as other:  # the range the view keeps is found again, not imported again
        mark(f"a new client's get, same pool: {other.get(desc, verify=False).data_ptr() == view.data_ptr()}")
    gc.enable()
    gc.collect()  # a collection does not take it from the view either
    gc.disable()
    mark("drop the view")
    del view
    mark("end")


def fabric_gets() -> None:
    """Three gets, each view dropped before the next, of another node's feature ($FAKE_CUDA_SCENARIO_DESC)
    whose owner's FABRIC handle this node's daemon ($MMFEAT_RUNTIME_DIR) relays; then the client closes."""
    from mmfeat.client import Client

    fake_torch_cuda(0)
    cpu_dlpack()
    runtime_context(0)
    gc.disable()
    desc = bytes.fromhex(os.environ["FAKE_CUDA_SCENARIO_DESC"])
    c = Client(timeout=20)
    for i in range(3):
        view = c.get(desc)
        mark(f"get {i}: {tuple(view.shape)}")
        del view
    mark("close the client")
    c.close()
    mark("client closed")
    mark("end")


def fork_while_importing() -> None:
    """A thread holds the GPU pool cache's lock across a fork; the forked child maps a pool of its own."""
    from mmfeat.client.gpu import cuda_import
    from tests.forking import fork_holding, reap

    fake_torch_cuda(0)
    cpu_dlpack()
    pid = fork_holding([cuda_import._lock],
                       lambda: cuda_import.map_cuda_pool("ep", pool_info(), os.memfd_create("pool")))
    try:
        mark(f"child exited {reap(pid, 'child hung')}")
    except AssertionError:
        mark("child hung")


def child_drops_parents_pool() -> None:
    """A forked child drops its copy of the parent's mapping; then the parent drops its own."""
    from mmfeat.client.gpu import cuda_import

    fake_torch_cuda(0)
    cpu_dlpack()
    runtime_context(0)
    m = cuda_import.map_cuda_pool("ep", pool_info(), os.memfd_create("pool"))
    pid = os.fork()
    if pid == 0:
        mark("the child drops its copy")
        del m
        gc.collect()
        mark("the child dropped it")
        os._exit(0)
    os.waitpid(pid, 0)
    mark("the parent drops the pool")
    del m
    mark("end")


def remap_while_unmapping() -> None:
    """A thread drops the last reference to a GPU pool's range, and the driver takes its time to unmap it
    (STUB_UNMAP_SLEEP_MS); meanwhile the main thread maps the same pool again."""
    import threading

    from mmfeat.client.gpu import cuda_import

    fake_torch_cuda(0)
    cpu_dlpack()
    runtime_context(0)
    gc.disable()  # the range goes by reference counting, in the thread that drops it
    held = [cuda_import.map_cuda_pool("ep", pool_info(), os.memfd_create("pool"))]
    dropper = threading.Thread(target=held.clear)
    dropper.start()
    deadline = time.monotonic() + 60
    while "cuMemUnmap(" not in Path(LOG).read_text():
        assert time.monotonic() < deadline, "the range was never unmapped"
        time.sleep(0.01)
    mark("unmapping")
    again = None
    try:
        again = cuda_import.map_cuda_pool("ep", pool_info(), os.memfd_create("pool"))
        outcome = f"mapped: {again.range.va is not None}"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    dropper.join(60)
    mark(f"mapped again while unmapping: {outcome}")
    del again
    mark("end")


def short_fabric_handle() -> None:
    """A FABRIC pool whose relayed handle is 10 bytes, not 64."""
    from mmfeat.client.gpu import cuda_import
    from mmfeat.protos.messages import PoolInfo

    fake_torch_cuda(0)
    info = PoolInfo(pool=0, epoch=1, kind="cuda", device=0, size=64 << 20, handle="fabric", fabric=b"\x01" * 10,
                    uuid="remote:n2")
    try:
        cuda_import.map_cuda_pool("mesh:n2", info, None)
        mark("mapped")
    except RuntimeError as exc:
        mark(f"{type(exc).__name__}: {exc}")


def _pinned_mapping() -> Any:
    from mmfeat.client.link import mapping as mapping_cache

    fd = os.memfd_create("pool")
    os.ftruncate(fd, 4 << 20)
    return mapping_cache.map_host_pool("ep", 0, 1, fd, 4 << 20, False)


def pin_two_devices() -> None:
    """Staged gets from one host pool to GPU 0 and then GPU 1 (both in use here); then the mapping goes."""
    from mmfeat.client.link import mapping as mapping_cache
    from mmfeat.client.consume.pinned import pinned_view

    fake_torch_cuda(0)
    runtime_context(0)
    runtime_context(1)
    m = _pinned_mapping()
    views = [pinned_view(m, dev) for dev in (0, 1)]
    mark(f"pinned: {sum(v is not None for v in views)}")
    del views
    mapping_cache._cache.clear()
    mark("drop the mapping")
    del m
    gc.collect()
    mark("end")


def child_drops_pinned_pool() -> None:
    """A forked child drops its copy of a pinned host mapping; then the parent drops its own."""
    from mmfeat.client.link import mapping as mapping_cache
    from mmfeat.client.consume.pinned import pinned_view

    fake_torch_cuda(0)
    runtime_context(0)
    m = _pinned_mapping()
    view = pinned_view(m, 0)
    mapping_cache._cache.clear()
    pid = os.fork()
    if pid == 0:
        mark("the child drops its copy")
        del m, view
        gc.collect()
        mark("the child dropped it")
        os._exit(0)
    os.waitpid(pid, 0)
    mark("the parent drops it")
    del m, view
    gc.collect()
    mark("end")


def fabric_probe_without_nvml() -> None:
    """The daemon's FABRIC probe on a node whose NVML says nothing of a fabric."""
    from mmfeat.daemon.pools.fabric_probe import probe_fabric

    drv.nvml_fabric_state = lambda ordinal: (False, "NVML: no fabric on this node")
    mark(f"verdict: {probe_fabric(0).reason}")


SCENARIOS = {f.__name__: f for f in (wrap_fails, restore_current, owner_never_used, daemon_two_pools,
                                      map_failure_remembered, failed_map_holds_nothing, fabric_get, pin_host_pool,
                                      pool_lifetime, fabric_gets, fork_while_importing, child_drops_parents_pool,
                                      remap_while_unmapping, short_fabric_handle, pin_two_devices,
                                      child_drops_pinned_pool, fabric_probe_without_nvml)}

if __name__ == "__main__":
    from tests.fake_cuda.bounded_scenarios import BOUNDED
    from tests.fake_cuda.early_ack_scenarios import EARLY_ACK
    from tests.fake_cuda.order_scenarios import ORDER
    from tests.fake_cuda.ready_scenarios import READY
    from tests.fake_cuda.staged_scenarios import STAGED

    SCENARIOS.update(ORDER)
    SCENARIOS.update(READY)
    SCENARIOS.update(STAGED)
    SCENARIOS.update(EARLY_ACK)
    SCENARIOS.update(BOUNDED)
    drv.driver_unavailable_reason()
    SCENARIOS[sys.argv[1]]()
