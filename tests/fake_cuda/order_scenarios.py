"""Scenarios of GPU order against the fake libcuda's streams and events (tests/fake_cuda/fake_torch.py):
GPU work that stays queued until the scenario releases it, and what the client gives back meanwhile.
Run through scenarios.py, like the others; each leaves its findings in the driver's log as ``=== ``
marks, and the fake logs each completion (``.. done op``), so a test reads the order."""

from __future__ import annotations

import gc
import io
import os
import pickle
import threading
import time
from typing import Any, Callable

import msgpack
import torch

from tests.fake_cuda import fake_torch as ft

LOG = os.environ.get("STUB_LOG", os.devnull)
PUBLISHED = 2  # client/link/lease_table.py's state of a live, published lease


def mark(text: str) -> None:
    with open(LOG, "a") as f:
        f.write(f"=== {text}\n")


def _desc() -> Any:
    from mmfeat.protos.descriptor import Descriptor

    return Descriptor.from_bytes(bytes.fromhex(os.environ["FAKE_CUDA_SCENARIO_DESC"]))


def _setup() -> None:
    from tests.fake_cuda.scenarios import cpu_dlpack

    ft.install()
    cpu_dlpack()


def _live(c: Any, desc: Any) -> bool:
    """The lease table's word on the feature: live (no ack applied) or not."""
    return c._connect().table.state(desc.lease, desc.gen, desc.pool, desc.offset, desc.nbytes) == PUBLISHED


def _stays_live(c: Any, desc: Any, seconds: float = 0.3) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _live(c, desc):
            return False
        time.sleep(0.01)
    return True


def _freed_soon(c: Any, desc: Any, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _live(c, desc):
            return True
        time.sleep(0.01)
    return False


class _Ref(pickle.Pickler):
    def persistent_id(self, o: Any) -> Any:
        return 0 if o == "pooled tensor" else None


def parcel_view_dies_under_a_kernel() -> None:
    """A Parcel's GPU view is dropped while a kernel queued on the current stream reads it."""
    from mmfeat.client import Client, loads

    _setup()
    desc = _desc()
    buf = io.BytesIO()
    _Ref(buf, protocol=5).dump({"x": "pooled tensor"})
    data = msgpack.packb([1, desc.to_bytes(), buf.getvalue()], use_bin_type=True)
    with Client(timeout=20) as c:
        parcel = loads(data, client=c)
        x = parcel.value["x"]
        ft.launch(torch.cuda.current_stream(0), "read-x")
        del parcel, x
        gc.collect()
        mark(f"views dropped with a kernel queued; still live: {_stays_live(c, desc)}")
        ft.release("read-x")
        mark(f"acked once the kernel is done: {_freed_soon(c, desc)}")


def _host_feature(c: Any) -> Any:
    return c.put(torch.ones(1 << 20, dtype=torch.uint8))  # over the inline threshold: in the host pool


def staged_ack_names_another_stream() -> None:
    """A staged get's copy queued on stream A behind a kernel; the ack names an idle stream B."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        desc = _host_feature(c)
        a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
        with torch.cuda.stream(a):
            ft.launch(a, "busy")
            c.get(desc, device=0)
        try:
            c.ack(desc, after="not a stream")  # acks nothing: the next ack must still wait for the copy
        except TypeError:
            pass
        c.ack(desc, after=b)
        mark(f"acked after an idle stream, copy queued; still live: {_stays_live(c, desc)}")
        ft.release("busy")
        mark(f"acked once the copy is done: {_freed_soon(c, desc)}")


def two_staged_gets_one_ack() -> None:
    """Two staged gets of one feature, on stream A (behind a kernel) and then on stream B; one plain ack."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        desc = _host_feature(c)
        a, b = torch.cuda.Stream(0), torch.cuda.Stream(1)
        with torch.cuda.stream(a):
            ft.launch(a, "busy")
            c.get(desc, device=0)
        with torch.cuda.stream(b):
            c.get(desc, device=1)
        c.ack(desc)
        mark(f"acked with the first copy queued; still live: {_stays_live(c, desc)}")
        ft.release("busy")
        mark(f"acked once both copies are done: {_freed_soon(c, desc)}")


def acker_on_device_1() -> None:
    """A consumer on GPU 1 only acks after a stream of GPU 1; the acker must wait in GPU 1's context."""
    from mmfeat.client import Client

    _setup()
    torch.cuda.set_device(1)
    with Client(timeout=20) as c:
        desc = _host_feature(c)
        s = torch.cuda.Stream(1)
        ft.launch(s, "work")
        c.ack(desc, after=s)
        deadline = time.monotonic() + 30
        while not ft.waiting() and time.monotonic() < deadline:
            time.sleep(0.01)  # until a thread of ours sleeps on the work's event
        ft.release("work")
        mark(f"acked: {_freed_soon(c, desc)}")


def ack_while_another_thread_captures() -> None:
    """The acker waits for GPU work while the main thread captures a graph in global mode."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        desc = _host_feature(c)
        work, graph = torch.cuda.Stream(0), torch.cuda.Stream(0)
        ft.launch(work, "work")
        ft.begin_capture(graph)
        c.ack(desc, after=work)
        time.sleep(0.2)  # the acker is in its wait now
        ft.release("work")
        freed = _freed_soon(c, desc)
        mark(f"capture: {ft.end_capture(graph)}; acked: {freed}")


def long_kernel_delays_no_other_ack() -> None:
    """An ack behind a long kernel on stream A, then one behind a short one on stream B."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        first, second = _host_feature(c), _host_feature(c)
        a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
        ft.launch(a, "long")
        ft.launch(b, "short")
        c.ack(first, after=a)
        c.ack(second, after=b)
        ft.release("short")
        mark(f"the short one's ack while the long kernel runs: {_freed_soon(c, second)}")
        mark(f"the long one's ack meanwhile: {not _live(c, first)}")
        ft.release("long")
        mark(f"the long one's ack after it: {_freed_soon(c, first)}")


def ack_after_and_wait() -> None:
    """ack(after=stream, wait=True): returns the daemon's answer, once the work is done."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        desc = _host_feature(c)
        s = torch.cuda.Stream(0)
        ft.launch(s, "work")
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(c.ack(desc, after=s, wait=True)))
        t.start()
        t.join(0.3)
        mark(f"returned while the work is queued: {not t.is_alive()}")
        ft.release("work")
        t.join(20)
        mark(f"answer: {out}")


def _publish_in_thread(publish: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(publish()))
    t.start()
    return t, out


def dropped_reservation_under_a_kernel() -> None:
    """A reserved GPU tensor with a kernel writing it on the current stream: dropped, then discarded."""
    from mmfeat.client import Client
    from mmfeat.client.produce.reservations import _ATTR

    _setup()
    with Client(timeout=20) as c:
        for how in ("drop", "discard"):
            t = c.reserve((1 << 20,), torch.uint8, device="cuda:0")
            r = getattr(t, _ATTR)
            mark(f"{how}: a reservation of kind {r.kind}")
            ft.launch(torch.cuda.current_stream(0), f"write-{how}")
            given: list[str] = []
            if r.kind == "arena":
                placed = r.placed
                back = lambda: placed.abandoned  # noqa: E731
            else:
                original = c._connect().fd.try_send if how == "drop" else c._connect().fd.send

                def spy(*a: Any, **k: Any) -> Any:
                    given.append(a[0])
                    return original(*a, **k)

                setattr(c._connect().fd, "try_send" if how == "drop" else "send", spy)
                back = lambda: "release" in given  # noqa: E731
            if how == "drop":
                del t, r
                gc.collect()
            else:
                c.discard(t)
            time.sleep(0.3)
            mark(f"{how}: given back while the kernel is queued: {back()}")
            ft.release(f"write-{how}")
            assert c.flush(20)
            mark(f"{how}: given back after it: {back()}")


def get_for_device_1() -> None:
    """get(desc, device=1) of a GPU pool feature, in a process whose current device is 0 (never used)."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        out = c.get(_desc(), device=1)
        mark(f"got {tuple(out.shape)}")


def _drop_pool_view(c: Any) -> None:
    """A GPU pool's last view dies and the client closes: the range's finaliser unmaps it."""
    view = c.get(_desc(), verify=False)
    c.ack(_desc())
    c.close()
    del view
    gc.collect()


def pool_unmapped_while_another_thread_captures() -> None:
    """A collection in this thread unmaps a GPU pool while another thread captures in global mode."""
    from mmfeat.client import Client

    _setup()
    torch.cuda.current_stream(0)  # this process uses GPU 0: the unmap synchronises it
    begun, dropped = threading.Event(), threading.Event()
    result: list[str] = []

    def capture() -> None:
        graph = torch.cuda.Stream(0)
        ft.begin_capture(graph)
        begun.set()
        dropped.wait(20)
        result.append(ft.end_capture(graph))

    t = threading.Thread(target=capture)
    t.start()
    begun.wait(20)
    _drop_pool_view(Client(timeout=20))
    mark(f"unmapped: {'cuMemUnmap(' in open(LOG).read()}")
    dropped.set()
    t.join(20)
    mark(f"capture: {result[0]}")


def pool_unmapped_in_a_capturing_thread() -> None:
    """A collection unmaps a GPU pool in the very thread that captures on its current stream."""
    from mmfeat.client import Client

    _setup()
    graph = torch.cuda.Stream(0)
    c = Client(timeout=20)
    with torch.cuda.stream(graph):
        ft.begin_capture(graph)
        _drop_pool_view(c)
        mark(f"unmapped during the capture: {'cuMemUnmap(' in open(LOG).read()}")
        mark(f"capture: {ft.end_capture(graph)}")
    deadline = time.monotonic() + 60
    while "cuMemUnmap(" not in open(LOG).read() and time.monotonic() < deadline:
        time.sleep(0.01)
    mark(f"unmapped after it: {'cuMemUnmap(' in open(LOG).read()}")


ORDER = {f.__name__: f for f in (pool_unmapped_while_another_thread_captures, pool_unmapped_in_a_capturing_thread,
                                  parcel_view_dies_under_a_kernel, staged_ack_names_another_stream,
                                  two_staged_gets_one_ack, acker_on_device_1, ack_while_another_thread_captures,
                                  long_kernel_delays_no_other_ack, ack_after_and_wait,
                                  dropped_reservation_under_a_kernel, get_for_device_1)}
