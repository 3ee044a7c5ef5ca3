"""Scenarios of the client's waits for GPU work against the fake libcuda: each ends within a bound it
states, with a typed error, and waits only for its own work. Staged copies past the consumer's bound,
gets and acks of a feature whose GPU never writes it, a consumer whose producer and daemon both die
under its stream's wait, the legacy stream while a blocking stream captures, a publish inside a capture.
Run through scenarios.py; each leaves ``=== `` marks in the driver's log, a second process (the
producer) in $FAKE_CUDA_CONSUMER_LOG."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from tests.fake_cuda import fake_torch as ft
from tests.fake_cuda.order_scenarios import _freed_soon, _host_feature, _setup, _stays_live, mark
from tests.fake_cuda.ready_scenarios import _start


def _until(done: Callable[[], bool], seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _outcome(call: Callable[[], Any]) -> str:
    """What ``call`` did: "returned", or the code (or type) of what it raised."""
    from mmfeat.protos.errors import MmfeatError

    try:
        call()
        return "returned"
    except MmfeatError as exc:
        return exc.code.value if exc.code is not None else type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - the scenario reports it
        return type(exc).__name__


def staged_copies_past_the_bound() -> None:
    """A consumer's book of staged copies holds one (its bound, set low): a second staged get waits for
    the first copy, queued behind a kernel, for the client's timeout at most ($FAKE_CUDA_TIMEOUT), and
    the first feature's ack waits for that copy however the wait ended."""
    from mmfeat.client import Client

    _setup()
    timeout = float(os.environ.get("FAKE_CUDA_TIMEOUT", "20"))
    with Client(timeout=timeout) as c:
        c._consumer._pending._limit = 1
        a, b = _host_feature(c), _host_feature(c)
        s = torch.cuda.Stream(0)
        ft.launch(s, "busy")
        with torch.cuda.stream(s):
            c.get(a, device=0)  # its copy queued behind the kernel
        said: list[str] = []

        def second() -> None:
            with torch.cuda.stream(s):
                said.append(_outcome(lambda: c.get(b, device=0)))

        t = threading.Thread(target=second)
        t.start()
        _until(lambda: ft.pending(s) >= 3 or not t.is_alive())  # the kernel and both copies
        if timeout >= 10:
            t.join(1.0)
            waited = t.is_alive()
            mark(f"the get past the bound waits for the oldest copy: {waited}")
            if not waited:  # the first copy is still queued behind the kernel: its ack must wait for it
                mark(f"it: {said}")
                c.ack(a)
                mark(f"the first feature acked with its copy queued; still live: {_stays_live(c, a)}")
            ft.release("busy")
            t.join(30)
            mark(f"the get past the bound: {said}")
            if waited:
                c.ack(a)
        else:
            t.join(30)
            mark(f"the get past the bound: {said}; the first copy still queued: {ft.pending(s) >= 2}")
            c.ack(a)
            mark(f"the first feature acked with its copy queued; still live: {_stays_live(c, a)}")
            ft.release("busy")
        mark(f"freed once the copy ran: {_freed_soon(c, a)}")
        c.ack(b)
        mark(f"the second freed: {_freed_soon(c, b)}")


def publish_and_hold() -> None:
    """Publish a reserved GPU tensor behind a fill that is never let go, say its descriptor, and stay
    (a live producer whose GPU never writes) until stdin closes."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        t = c.reserve((1 << 20,), torch.uint8, device="cuda:0")
        ft.launch(torch.cuda.current_stream(0), "never")
        desc = c.publish(t)
        print(desc.to_bytes().hex(), flush=True)
        sys.stdin.read()
        os._exit(0)  # its close would wait for the fill it never lets go


def a_feature_its_gpu_never_writes() -> None:
    """A live producer publishes behind a fill that never runs (the daemon: a short ack_ttl and
    ready_ttl). A copying get gives up after ready_ttl with no GPU wait queued; a view's stream waits
    on the GPU, its ack after that stream is sent once the daemon let the word go, and finds the read
    lost; later gets and acks say LOST."""
    from mmfeat.client import Client
    from mmfeat.protos.descriptor import Descriptor

    _setup()
    producer = _start("publish_and_hold", {}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert producer.stdout is not None and producer.stdin is not None
    desc = Descriptor.from_bytes(bytes.fromhex(producer.stdout.readline().strip()))
    with Client(timeout=20) as c:
        stream = torch.cuda.current_stream(0)
        t0 = time.monotonic()
        mark(f"a copying get: {_outcome(lambda: c.get(desc, copy=True))}; waits queued on the stream: "
             f"{ft.pending(stream)}; within ready_ttl and the client's timeout: "
             f"{time.monotonic() - t0 < c._connect().ready_ttl + 20}")
        view = c.get(desc)
        mark(f"a view: waits queued on the stream: {ft.pending(stream)}")
        c.ack(desc, after=stream)
        mark(f"the stream went on once the daemon let the word go: {_until(lambda: ft.pending(stream) == 0, 60)}")
        mark(f"the ack after it found the read lost: {_until(lambda: c.lost_reads >= 1)}; lost_reads {c.lost_reads}")
        mark(f"a later get: {_outcome(lambda: c.get(desc))}")
        mark(f"a waited ack: {_outcome(lambda: c.ack(desc, wait=True))}")
        mark(f"async failures: {sorted(c.async_failures)}; lost_reads {c.lost_reads}")
        mark(f"stats lost_reads {c.stats()['counters']['lost_reads']}")
        del view
    producer.stdin.close()
    producer.wait(20)


def daemon_and_producer_die_under_a_wait() -> None:
    """A consumer's stream waits on a feature; its producer and the daemon are both SIGKILLed before
    anyone wrote the word. The consumer goes on: its next call meets the new daemon (its wait on the
    old table let go, a lost read), its close returns, and the old table is unpinned once its stream
    ran, with no device synchronise."""
    from mmfeat.client import Client
    from mmfeat.protos.descriptor import Descriptor
    from mmfeat.testing import spawn_daemon

    _setup()
    runtime = Path(os.environ["MMFEAT_RUNTIME_DIR"])
    producer = _start("publish_and_hold", {}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert producer.stdout is not None
    desc = Descriptor.from_bytes(bytes.fromhex(producer.stdout.readline().strip()))
    c = Client(timeout=5)
    stream = torch.cuda.current_stream(0)
    views = [c.get(desc)]
    mark(f"waits queued on the stream: {ft.pending(stream)}")
    os.kill(int(os.environ["FAKE_CUDA_DAEMON_PID"]), signal.SIGKILL)
    producer.kill()
    producer.wait(20)
    _until(lambda: not c._session.alive())  # the daemon's end, seen on the fd channel
    log = open(os.environ["FAKE_CUDA_DAEMON2_LOG"], "w")
    second = spawn_daemon(runtime, ["--backend", "cuda_vmm", "--devices", "0", "--pool-mb", "16"], stdout=log,
                          stderr=log, env={**os.environ, "STUB_LOG": os.environ["FAKE_CUDA_DAEMON2_LOG"] + ".driver"})
    try:
        done = threading.Event()
        said: list[str] = []

        def use() -> None:
            said.append(_outcome(c.connect))  # a session with the new daemon
            done.set()

        threading.Thread(target=use, daemon=True).start()
        mark(f"the next call returned: {done.wait(30)} ({said})")
        mark(f"the stream went on: {_until(lambda: ft.pending(stream) == 0)}; lost_reads {c.lost_reads}")
        closer = threading.Thread(target=c.close, daemon=True)
        closer.start()
        closer.join(30)
        mark(f"closed: {not closer.is_alive()}")
        views.clear()  # with the Client, the old table's last references: its registration goes
        c = None
        gc.collect()
        mark("dropped")
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)


def get_on_the_legacy_stream_while_another_captures() -> None:
    """A GPU feature published behind a held fill is got on the legacy stream while another thread
    captures a blocking stream of the same device: the driver cannot say whether the legacy stream
    captures, so the get waits on the host instead of raising, and the capture survives."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        t = c.reserve((1 << 16,), torch.uint8, device="cuda:0")
        side = torch.cuda.Stream(0)
        ft.launch(side, "fill")
        desc = c.publish(t, after=side)
        end, th, ended = _capture_in_another_thread()
        legacy = type("Legacy", (), {"cuda_stream": 0, "device_index": 0})()
        said: list[str] = []
        getter = threading.Thread(target=lambda: said.append(_outcome(lambda: c.get(desc, stream=legacy))))
        getter.start()
        getter.join(0.5)
        mark(f"waiting on the host: {getter.is_alive()} ({said})")
        ft.release("fill")
        _until(lambda: ft.pending(side) == 0 and c._connect().table.is_ready(desc.lease, desc.gen))
        getter.join(30)
        mark(f"the get: {said}")
        end.set()
        th.join(30)
        mark(f"the capture: {ended}")
        c.ack(desc)


def publish_inside_a_capture() -> None:
    """A GPU reservation published on a stream that is being captured: refused, and the capture intact."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        t = c.reserve((1 << 16,), torch.uint8, device="cuda:0")
        s = torch.cuda.Stream(0)
        ft.begin_capture(s, 0)
        with torch.cuda.stream(s):
            said = _outcome(lambda: c.publish(t))
        mark(f"publish inside a capture: {said}; the capture: {ft.end_capture(s)}")
        mark(f"published after it: {_outcome(lambda: c.ack(c.publish(t)))}")


def first_gpu_use_while_another_thread_captures() -> None:
    """The table's first GPU use (its registration and device address) while another thread captures
    in global mode: the capture survives."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        t = c.reserve((1 << 16,), torch.uint8, device="cuda:0")
        end, th, ended = _capture_in_another_thread()
        side = torch.cuda.Stream(0)
        desc = c.publish(t, after=side)
        end.set()
        th.join(30)
        mark(f"the capture: {ended}")
        status = Path("/proc/self/status").read_text()
        locked = next(line.split()[1] for line in status.splitlines() if line.startswith("VmLck:"))
        mark(f"the table locked in memory: {int(locked) > 0}")
        c.ack(desc)


def _capture_in_another_thread() -> tuple[threading.Event, threading.Thread, list[str]]:
    """A thread that begins a global-mode capture on a blocking stream of its own (as the fake's streams
    are) and ends it once the event is set; returns when the capture has begun. ``ended`` gets what
    ending it said."""
    captured = torch.cuda.Stream(0)
    began, end = threading.Event(), threading.Event()
    ended: list[str] = []

    def capture() -> None:
        ft.begin_capture(captured, 0)
        began.set()
        end.wait(30)
        ended.append(ft.end_capture(captured))

    th = threading.Thread(target=capture)
    th.start()
    began.wait(30)
    return end, th, ended


BOUNDED = {f.__name__: f for f in (staged_copies_past_the_bound, publish_and_hold, a_feature_its_gpu_never_writes,
                                    daemon_and_producer_die_under_a_wait,
                                    get_on_the_legacy_stream_while_another_captures, publish_inside_a_capture,
                                    first_gpu_use_while_another_thread_captures)}
