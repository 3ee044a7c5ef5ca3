"""On a GPU: the import itself, acks after GPU work, and what the daemon's CUDA context costs.
Each prints the numbers docs/gpu.md reports (pytest -rA shows them)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from ..conftest import start_daemon

pytestmark = pytest.mark.gpu
POOL_MB = 256


@pytest.fixture
def gpu_daemon(runtime_dir):
    d = start_daemon(runtime_dir, "--pool-mb", str(POOL_MB), backend="cuda_vmm")
    yield d
    rc = d.stop()
    _, err = d.proc.communicate()
    assert rc == 0, err


def test_a_posix_fd_export_imported_twice_in_one_process(gpu_daemon) -> None:
    from mmfeat.client.gpu import cuda_import

    torch.cuda.set_device(0)
    with gpu_daemon.client() as c:
        session = c.session
        info = next(p for p in session.pools.values() if p.kind == "cuda")
        before = torch.cuda.memory_allocated(0)
        # Two imports under two cache keys: two VA ranges over the same physical pool.
        a = cuda_import.map_cuda_pool("first", info, os.dup(session.fds[info.pool]))
        b = cuda_import.map_cuda_pool("second", info, os.dup(session.fds[info.pool]))
        assert a.tensor.data_ptr() != b.tensor.data_ptr(), "one VA for two imports"
        assert a.tensor.device == b.tensor.device == torch.device("cuda", 0)
        a.tensor[:4096].fill_(0x5A)
        torch.cuda.synchronize(0)
        assert int(b.tensor[:4096].sum()) == 0x5A * 4096, "a write through one mapping is not seen through the other"
        grown = torch.cuda.memory_allocated(0) - before
        print(f"two imports of a {POOL_MB} MiB pool: VAs {a.tensor.data_ptr():#x} and {b.tensor.data_ptr():#x}; "
              f"torch's caching allocator grew by {grown} B")
        assert grown < info.size, "the pool was copied into torch's allocator instead of viewed"


def _acker_cpu_seconds(client) -> float:
    """CPU time of the client's acker threads, found by their native ids (CPython names OS threads
    only from 3.14, so /proc's comm cannot find them)."""
    acker = client._acks._acker
    assert acker is not None, "no acker thread: the ack did not go through it"
    total = 0.0
    for _, thread in list(acker._lanes.values()):
        with open(f"/proc/self/task/{thread.native_id}/stat") as g:
            fields = g.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def test_ack_after_stream_waits_for_the_kernel_that_reads(gpu_daemon) -> None:
    torch.cuda.set_device(0)
    with gpu_daemon.client(inline_threshold=0, fallback="error") as producer, gpu_daemon.client() as consumer:
        desc = producer.put(torch.ones(1 << 20, device="cuda:0"), consumers=1)
        view = consumer.get(desc)
        stream = torch.cuda.Stream(0)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(2e9))  # about a second of GPU time before the read
            total = view.sum()
        consumer.ack(desc, after=stream)
        t0, cpu0 = time.monotonic(), _acker_cpu_seconds(consumer)
        time.sleep(0.2)
        s = gpu_daemon.stats()
        assert s["pools"][0]["leases"]["PUBLISHED"] == 1, "the lease was freed while a kernel still read it"
        assert consumer.flush(30.0)
        waited, cpu = time.monotonic() - t0, _acker_cpu_seconds(consumer) - cpu0
        assert int(total.item()) == 1 << 20
        s = gpu_daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the ack after the kernel")
        print(f"ack(after=stream): lease held {waited:.2f} s until the kernel ended; "
              f"the acker thread used {cpu:.3f} s of CPU")
        assert cpu < 0.5 * waited + 0.05, "the acker spun a core while it waited"


def test_staged_copy_is_complete_before_a_plain_ack(gpu_daemon) -> None:
    """The consumer's copy runs on stream A behind a long kernel, the producer's overwrite on stream B:
    only get() waiting for the copy keeps the overwrite from reaching it (one stream would order them
    whatever the code did)."""
    torch.cuda.set_device(0)
    a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
    with gpu_daemon.client(inline_threshold=0, fallback="error") as p, gpu_daemon.client() as c:
        for k in range(5):
            src = torch.full((4 << 20,), float(k), device="cuda:0")
            torch.cuda.synchronize()
            d = p.put(src)
            with torch.cuda.stream(a):
                torch.cuda._sleep(int(1e8))
                mine = c.get(d, device=0)
            c.ack(d, wait=True)  # frees at once: the next put may take the same range
            with torch.cuda.stream(b):
                p.ack(p.put(torch.full((4 << 20,), -1.0, device="cuda:0")))
            torch.cuda.synchronize()
            assert torch.equal(mine, src), f"round {k}: the staged copy read a reused range"


def test_a_read_only_consumers_write_in_place_cannot_change_a_gpu_feature(gpu_daemon) -> None:
    """Client(readonly=True) maps a GPU pool with read-only access: the kernel that writes faults (the
    child dies or raises) and the feature keeps the producer's bytes."""
    import subprocess
    import sys

    torch.cuda.set_device(0)
    code = ("import sys, torch; from mmfeat.client import Client; torch.cuda.set_device(0)\n"
            "c = Client(sys.argv[1], readonly=True); v = c.get(bytes.fromhex(sys.argv[2]))\n"
            "print('read', float(v.max()), flush=True); v /= 255; torch.cuda.synchronize()\n"
            "print('wrote', flush=True)\n")
    with gpu_daemon.client(inline_threshold=0, fallback="error") as c:
        d = c.put(torch.full((1 << 20,), 255.0, device="cuda:0"), consumers=1)
        out = subprocess.run([sys.executable, "-c", code, str(gpu_daemon.runtime_dir), d.to_bytes().hex()],
                             capture_output=True, text=True, timeout=120)
        print(f"a read-only consumer's write in place: exit {out.returncode}, stderr tail {out.stderr[-300:]!r}")
        assert "read 255.0" in out.stdout, out.stderr
        assert "wrote" not in out.stdout and out.returncode != 0
        assert float(c.get(d).min()) == 255.0, "the read-only consumer's write reached the feature"
        c.ack(d, wait=True)


def test_a_parcels_cuda_tensors_keep_their_feature_until_they_die(gpu_daemon) -> None:
    """``loads(data).value`` on a GPU pool: the tensors hold the feature (DLPack on kDLCUDA), so puts
    that reuse freed ranges cannot reach them, and the ack comes once they are gone."""
    from mmfeat.client import dumps, loads

    torch.cuda.set_device(0)
    with gpu_daemon.client(inline_threshold=0, fallback="error") as p, gpu_daemon.client() as c:
        src = torch.full((1 << 20,), 7.0, device="cuda:0")
        x = loads(dumps({"x": src}, client=p), client=c).value["x"]
        assert x.device == torch.device("cuda", 0)
        for _ in range(64):
            p.ack(p.put(torch.full((1 << 20,), 238.0, device="cuda:0")), wait=True)
        assert torch.equal(x, src), "a Parcel's tensor read bytes a later put wrote"
        assert gpu_daemon.stats()["leases"]["PUBLISHED"] == 1
        # A kernel queued on x when it dies: the automatic ack must wait for it, or the producer's next
        # puts (on another stream) overwrite the range before the kernel reads it.
        torch.cuda._sleep(int(5e8))
        y = x * 1
        del x
        other = torch.cuda.Stream(0)
        with torch.cuda.stream(other):
            for _ in range(64):
                p.ack(p.put(torch.full((1 << 20,), 238.0, device="cuda:0")), wait=True)
        torch.cuda.synchronize()
        assert torch.equal(y, src), "a kernel queued on a Parcel's dead tensor read bytes a later put wrote"
        assert c.flush()
        gpu_daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the ack once the tensor died")


def test_hbm_taken_by_the_daemons_cuda_context(gpu_daemon) -> None:
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        from mmfeat import cuda_driver as drv

        uuid = drv.device_uuid(0)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        used = None
        deadline = time.monotonic() + 10
        while used is None and time.monotonic() < deadline:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == gpu_daemon.pid:
                    used = p.usedGpuMemory
            time.sleep(0.2)
    finally:
        pynvml.nvmlShutdown()
    if used is None:
        pytest.skip("NVML does not list the daemon's process here (a container hides pids)")
    pool = gpu_daemon.pool()["capacity"]
    print(f"mmfeatd on {uuid}: {used >> 20} MiB of HBM for a {pool >> 20} MiB pool: "
          f"{(used - pool) >> 20} MiB beyond the pool (its CUDA context)")
    assert used >= pool


def test_the_daemon_logs_the_fabric_verdict_on_a_multinode_setting(runtime_dir) -> None:
    d = start_daemon(runtime_dir, "--pool-mb", "64", "--nnodes", "2", backend="cuda_vmm")
    try:
        handle = d.pool()["handle"]
    finally:
        d.stop()
        _, err = d.proc.communicate()
    verdict = [line for line in err.splitlines() if "FABRIC" in line or "fabric" in line]
    print("daemon's fabric verdict:", *verdict, sep="\n  ")
    assert verdict and handle in ("posix_fd", "fabric")


def test_a_put_and_a_staged_get_behind_a_long_kernel_sleep_instead_of_spinning(gpu_daemon) -> None:
    """A staged get must wait for the GPU (its copy is complete when get returns), and so must a put
    where the daemon asks for no READY words (the bytes exist before the descriptor); a wait that spans
    other work on the GPU must not burn a core (stream_wait.py), a put of a host tensor into the GPU
    pool (torch's synchronous copy) included."""
    torch.cuda.set_device(0)
    with gpu_daemon.client(inline_threshold=0, fallback="error") as c:
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
        c.ack(c.put(x))  # the mapping and the arena, outside the measurement
        x_host = x.cpu()  # pageable: torch copies it synchronously
        ready_words = c.stats()["gpu_publish"] == "ready_word"
        for step in ("put", "put from host memory", "staged get"):
            desc = c.put(x) if step == "staged get" else None
            torch.cuda._sleep(int(1e9))  # about half a second of GPU time queued first
            t0, cpu0 = time.monotonic(), time.thread_time()
            if step == "put":
                desc = c.put(x)
                got = c.get(desc)
            elif step == "put from host memory":  # torch's synchronous copy from pageable pages
                desc = c.put(x_host)
                got = c.get(desc)
            else:
                got = c.get(desc, device=0)
            waited, cpu = time.monotonic() - t0, time.thread_time() - cpu0
            print(f"{step} behind a {waited:.2f} s kernel: {cpu * 1e3:.1f} ms of CPU")
            if step == "put" and ready_words:  # published behind the stream: nothing waits on the host
                assert waited < 0.2, "the put waited on the host though the daemon asks for READY words"
                assert torch.equal(got, x)  # read on the stream, behind the READY word
                c.ack(desc, wait=True)
                continue
            assert waited > 0.2, f"the {step} returned before the queued kernel ended"
            assert torch.equal(got, x)
            c.ack(desc, wait=True)
            assert cpu < 0.25 * waited, f"the {step} spun a core while it waited"


def test_an_ack_after_gpu_work_leaves_soon_after_the_work_ends(gpu_daemon) -> None:
    """From the end of the kernel an ``ack(after=)`` waits for to the acker thread having sent it, for a
    stream and for a caller's own (busy-waiting) event: the thread sleeps on a blocking event until then."""
    torch.cuda.set_device(0)
    delays: dict[str, list[float]] = {"stream": [], "event": []}
    with gpu_daemon.client(inline_threshold=0, fallback="error") as producer, gpu_daemon.client() as consumer:
        for kind, found in delays.items():
            for _ in range(20):
                desc = producer.put(torch.ones(1 << 16, device="cuda:0"), consumers=1)
                stream = torch.cuda.Stream(0)
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(int(2e7))  # milliseconds of GPU time before the work ends
                    end = torch.cuda.Event(blocking=True)
                    end.record(stream)
                consumer.ack(desc, after=stream if kind == "stream" else end)
                acker = consumer._acks._acker
                # Both waits release the GIL: a thread spinning in Python here would hold it, and the
                # acker, awake, would wait out the interpreter's switch interval before it could send.
                end.synchronize()
                t_end = time.perf_counter()
                while acker._pending:
                    time.sleep(20e-6)
                found.append(time.perf_counter() - t_end)
            assert consumer.flush(30.0)
    for kind, found in delays.items():
        found.sort()
        median, worst = found[len(found) // 2], found[-1]
        print(f"ack(after={kind}): the ack left {median * 1e6:.0f} µs (median; worst {worst * 1e6:.0f} µs) "
              "after the work ended")
        assert median <= 200e-6, f"ack(after={kind}) left {median * 1e6:.0f} µs after the work ended"
