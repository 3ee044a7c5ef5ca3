"""Scenarios of the READY word (client/gpu/ready_word.py) against the fake libcuda: a GPU feature
published behind its producer's stream, read by another process whose stream waits for it, and let go
by the daemon when its producer dies first. Run through scenarios.py; each leaves ``=== `` marks in the
driver's log, the consumer process in a log of its own ($FAKE_CUDA_CONSUMER_LOG)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.fake_cuda import fake_torch as ft
from tests.fake_cuda.order_scenarios import LOG, _desc, _publish_in_thread, _setup, mark

SCENARIOS_PY = Path(__file__).with_name("scenarios.py")


def _size() -> int:
    return int(os.environ.get("FAKE_CUDA_SIZE", str(1 << 20)))


def _start(scenario: str, env: dict[str, str], **popen: Any) -> subprocess.Popen:
    """Another process of this test against the same daemon, logging to $FAKE_CUDA_CONSUMER_LOG."""
    full = {**os.environ, "STUB_LOG": os.environ["FAKE_CUDA_CONSUMER_LOG"], **env}
    if os.environ.get("FAKE_CUDA_CONSUMER_NO_MEM_OPS"):
        full["STUB_NO_STREAM_MEM_OPS"] = "1"
    return subprocess.Popen([sys.executable, str(SCENARIOS_PY), scenario], env=full, **popen)


def _logged(text: str, seconds: float = 120.0) -> bool:
    """Whether the other process's log says ``=== text`` within ``seconds``."""
    path = Path(os.environ["FAKE_CUDA_CONSUMER_LOG"])
    deadline = time.monotonic() + seconds
    while not (path.exists() and f"=== {text}" in path.read_text()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def publish_behind_the_fill() -> None:
    """A reserved GPU tensor filled on a side stream, published with after= that stream, while a consumer
    process gets it; the fill is let go only once the consumer has its view (or waits for it)."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        t = c.reserve((_size(),), torch.uint8, device="cuda:0")
        side = torch.cuda.Stream(0)
        ft.launch(side, "fill")
        host_waits = Path(LOG).read_text().count("cuEventSynchronize(")
        thread, out = _publish_in_thread(lambda: c.publish(t, after=side))
        # Until it returned or waits on the host for the fill (which the driver logs), however long a
        # busy machine takes to get there.
        deadline = time.monotonic() + 60
        while (not out and Path(LOG).read_text().count("cuEventSynchronize(") == host_waits
               and time.monotonic() < deadline):
            thread.join(0.01)
        mark(f"published before the fill was done: {bool(out)}")
        if not out:  # the host wait: nothing to read before the fill is done
            ft.release("fill")
            thread.join(20)
            desc = out[0]
            mark(f"published after it: {bool(out)}; ready then: {c._connect().table.is_ready(desc.lease, desc.gen)}")
            return
        desc = out[0]
        table = c._connect().table
        mark(f"ready before the fill: {table.is_ready(desc.lease, desc.gen)}")
        consumer = _start("consume_behind_ready", {"FAKE_CUDA_SCENARIO_DESC": desc.to_bytes().hex()})
        _logged("getting")
        if os.environ.get("FAKE_CUDA_CONSUMER_TIMEOUT"):  # a slow fill: longer than the consumer's timeout
            _logged("past the consumer's timeout", 60)
        # A consumer whose stream waits on the word has its view at once, however long a busy machine takes
        # to run it; one that waits on the host cannot have it before the fill: a moment shows that.
        on_the_host = bool(os.environ.get("FAKE_CUDA_CONSUMER_NO_MEM_OPS"))
        mark(f"the consumer had its view before the fill: {_logged('got', 0.3 if on_the_host else 60)}")
        ft.release("fill")
        deadline = time.monotonic() + 60
        while not table.is_ready(desc.lease, desc.gen) and time.monotonic() < deadline:
            ft.pending(side)  # the fake runs the GPU's queue as the driver is called
            time.sleep(0.01)
        mark(f"ready after the fill: {table.is_ready(desc.lease, desc.gen)}")
        mark(f"consumer exited {consumer.wait(30)}")


def two_fills_on_two_streams() -> None:
    """Two reservations filled on two side streams, the first behind work that stays queued: the
    second's READY word must not wait for the first's fill."""
    from mmfeat.client import Client

    _setup()
    with Client(timeout=20) as c:
        table = c._connect().table
        slow, quick = torch.cuda.Stream(0), torch.cuda.Stream(0)
        t1 = c.reserve((1 << 16,), torch.uint8, device="cuda:0")
        t2 = c.reserve((1 << 16,), torch.uint8, device="cuda:0")
        ft.launch(slow, "slow fill")
        d1 = c.publish(t1, after=slow)
        ft.launch(quick, "quick fill")
        d2 = c.publish(t2, after=quick)
        ft.release("quick fill")
        deadline = time.monotonic() + 60
        while not table.is_ready(d2.lease, d2.gen) and time.monotonic() < deadline:
            ft.pending(quick)
            time.sleep(0.01)
        mark(f"the quick one ready while the slow fill runs: {table.is_ready(d2.lease, d2.gen)}; "
             f"the slow one ready: {table.is_ready(d1.lease, d1.gen)}")
        ft.release("slow fill")


def early_ack_before_the_fill() -> None:
    """An arena feature published behind a held fill and acked at once by a consumer that never read
    it: its producer must not take its space back before the fill's READY word is written."""
    from mmfeat.client import Client
    from mmfeat.client.produce.reservations import _ATTR

    _setup()
    with Client(timeout=20) as c, Client(timeout=20) as other:
        table = c._connect().table
        t = c.reserve((1 << 16,), torch.uint8, device="cuda:0")
        arena = getattr(t, _ATTR).placed.arena
        side = torch.cuda.Stream(0)
        ft.launch(side, "fill")
        desc = c.publish(t, after=side)
        del t
        held = arena.used
        other.ack(desc)  # no after=: the consumer says it is done, and it never read
        deadline = time.monotonic() + 60
        while table.state_word(desc.lease) & 3 != 3 and time.monotonic() < deadline:  # DONE
            time.sleep(0.01)
        arena.reclaim()
        mark(f"acked: DONE {table.state_word(desc.lease) & 3 == 3}; space back before the fill: {arena.used < held}")
        ft.release("fill")
        while not table.is_ready(desc.lease, desc.gen) and time.monotonic() < deadline + 10:
            ft.pending(side)
            time.sleep(0.01)
        arena.reclaim()
        mark(f"space back after it: {arena.used < held}")


def early_ack_of_a_reserved_lease() -> None:
    """A reserved lease published behind a held fill and acked at once by a consumer that never read it:
    the feature ends, but its range stays out of the pool until the fill's READY word is written."""
    from mmfeat.client import Client
    from mmfeat.client.produce.reservations import _ATTR

    _setup()

    def used(c: Any) -> int:
        # Bytes outside arenas: the producer may be granted one meanwhile.
        return sum(p["used"] - p["arenas"]["bytes"] for p in c.stats()["pools"] if p["kind"] == "cuda")

    capped = os.environ.get("FAKE_CUDA_KEEP_CAPPED")  # the daemon's ack_ttl, where it is shorter than the fill
    with Client(timeout=20) as c, Client(timeout=20) as other:
        table = c._connect().table
        other.connect()
        before = used(c)
        t = c.reserve((4 << 20,), torch.uint8, device="cuda:0")  # past the largest arena: a reserved lease
        mark(f"a reservation of kind {getattr(t, _ATTR).kind}")
        side = torch.cuda.Stream(0)
        ft.launch(side, "fill")
        desc = c.publish(t, after=side)
        del t
        acked_at = time.monotonic()  # the range is kept for ack_ttl from the ack's end of the feature
        other.ack(desc, wait=True)  # no after=: the consumer says it is done, and it never read
        time.sleep(1.5)  # past the sweeps and the loop's ticks
        mark(f"ended: {table.state_word(desc.lease) >> 2 == desc.gen and table.state_word(desc.lease) & 3 == 0}; "
             f"range back before the fill: {used(c) == before}")
        if capped:  # a busy machine may have looked only once ack_ttl had passed: the test tries again then
            mark(f"looked within ack_ttl: {time.monotonic() - acked_at < float(capped)}")
        mark(f"unwritten {c.stats()['unwritten']}")
        if capped:
            deadline = time.monotonic() + float(capped) + 60
            while used(c) != before and time.monotonic() < deadline:
                time.sleep(0.05)
            mark(f"range back with the fill still queued, past ack_ttl: {used(c) == before}; "
                 f"ready: {table.is_ready(desc.lease, desc.gen)}")
        ft.release("fill")
        deadline = time.monotonic() + 10
        while used(c) != before and time.monotonic() < deadline:
            ft.pending(side)
            time.sleep(0.05)
        mark(f"range back after it: {used(c) == before}; ready: {table.is_ready(desc.lease, desc.gen)}")
        mark(f"unready_ended {c.stats()['counters']['unready_ended']}")


def consume_behind_ready() -> None:
    """get() of the descriptor in $FAKE_CUDA_SCENARIO_DESC: what the current stream (or, with
    $FAKE_CUDA_CONSUMER_STREAM, a stream of its own it names) holds after it, and whether it goes on
    once the READY word is written. $FAKE_CUDA_CONSUMER_TIMEOUT: the client's timeout, said to have
    passed while the get still waits."""
    import threading

    from mmfeat.client import Client
    from mmfeat.protos.errors import MmfeatError

    _setup()
    _say_decisions()
    desc = _desc()
    timeout = float(os.environ.get("FAKE_CUDA_CONSUMER_TIMEOUT", "20"))
    with Client(timeout=timeout) as c:
        current = torch.cuda.current_stream(0)
        own = os.environ.get("FAKE_CUDA_CONSUMER_STREAM")
        stream = torch.cuda.Stream(0) if own else current
        mark("getting")
        if os.environ.get("FAKE_CUDA_CONSUMER_TIMEOUT"):
            threading.Timer(timeout, mark, ["past the consumer's timeout"]).start()
        try:
            view = c.get(desc, stream=stream if own else None)
        except MmfeatError as exc:
            mark(f"the get raised {exc.code.value}")
            return
        mark(f"got {tuple(view.shape)}; waits queued on the stream: {ft.pending(stream)}; on the current stream: "
             f"{ft.pending(current)}")
        deadline = time.monotonic() + 60
        while ft.pending(stream) and time.monotonic() < deadline:
            time.sleep(0.01)
        ready = c._connect().table.is_ready(desc.lease, desc.gen)
        mark(f"the stream went on: {ft.pending(stream) == 0}; ready: {ready}")
        try:
            c.request("lookup", lease=desc.lease_ref())
            mark("lookup: live")
        except MmfeatError as exc:
            mark(f"lookup: {exc.code.value}")
        try:
            c.ack(desc)
        except MmfeatError:
            pass
        del view


def _say_decisions() -> None:
    """Mark in the log what the client says, at INFO, of each device's READY words (the decision is
    logged once per device: a device answering 0 turns them off without any error)."""
    import logging

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if record.levelno == logging.INFO and text.startswith("device "):
                mark(f"said: {text}")

    client_log = logging.getLogger("mmfeat.client")
    client_log.setLevel(logging.INFO)
    client_log.addHandler(Said())


def publish_and_die() -> None:
    """Publish a reserved GPU tensor behind a fill that never ends, say its descriptor, and wait to be
    killed."""
    from mmfeat.client import Client

    _setup()
    c = Client(timeout=20)
    t = c.reserve((_size(),), torch.uint8, device="cuda:0")
    ft.launch(torch.cuda.current_stream(0), "never")
    desc = c.publish(t)
    print(desc.to_bytes().hex(), flush=True)
    time.sleep(600)


def producer_dies_before_its_gpu_writes() -> None:
    """A consumer's stream waits on a feature whose producer is SIGKILLed before its fill ran."""
    from mmfeat.client import Client
    from mmfeat.protos.descriptor import Descriptor
    from mmfeat.protos.errors import MmfeatError

    _setup()
    producer = _start("publish_and_die", {}, stdout=subprocess.PIPE, text=True)
    assert producer.stdout is not None
    desc = Descriptor.from_bytes(bytes.fromhex(producer.stdout.readline().strip()))
    with Client(timeout=20) as c:
        stream = torch.cuda.current_stream(0)
        view = c.get(desc)
        mark(f"got {tuple(view.shape)}; waits queued on the stream: {ft.pending(stream)}")
        producer.send_signal(signal.SIGKILL)
        producer.wait(60)
        deadline = time.monotonic() + 60
        while ft.pending(stream) and time.monotonic() < deadline:
            time.sleep(0.01)
        mark(f"the stream went on after the producer died: {ft.pending(stream) == 0}")
        try:
            c.get(desc)
            mark("a later get: served")
        except MmfeatError as exc:
            mark(f"a later get: {exc.code.value}")
        try:  # the consumer that read it learns that the read was lost
            c.ack(desc, wait=True)
            mark("its waited ack: taken")
        except MmfeatError as exc:
            mark(f"its waited ack: {exc.code.value}: {exc}")
        counters = c.stats()["counters"]
        mark(f"unready_ended {counters['unready_ended']}")
        del view


def close_behind_the_fill() -> None:
    """A producer publishes behind a fill on its current stream and closes at once: the close waits for
    the fill (its READY write), and the feature stays for its consumer."""
    import threading

    from mmfeat.client import Client

    _setup()
    c = Client(timeout=20)
    t = c.reserve((_size(),), torch.uint8, device="cuda:0")
    ft.launch(torch.cuda.current_stream(0), "fill")
    desc = c.publish(t)
    del t
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join(0.3)
    mark(f"closed before the fill was done: {not closer.is_alive()}")
    ft.release("fill")
    closer.join(20)
    mark(f"closed after it: {not closer.is_alive()}")
    with Client(timeout=20) as other:
        time.sleep(0.5)  # past nothing: the daemon has no grace to run out for a feature written
        other.request("lookup", lease=desc.lease_ref())
        mark(f"still live, ready: {other._connect().table.is_ready(desc.lease, desc.gen)}")
        mark(f"unready_ended {other.stats()['counters']['unready_ended']}")


READY = {f.__name__: f for f in (publish_behind_the_fill, consume_behind_ready, publish_and_die,
                                  producer_dies_before_its_gpu_writes, close_behind_the_fill,
                                  two_fills_on_two_streams, early_ack_before_the_fill,
                                  early_ack_of_a_reserved_lease)}
