"""Scenarios of staged gets by key against the fake libcuda: the copy of a host-pool feature into a GPU,
queued behind a kernel, while another producer's put needs the feature's space. The fake copies a host
pool's bytes when its stream reaches the copy (fake_torch.land_copies), so what the consumer's tensor
holds is what the pool held when the DMA ran. Run through scenarios.py, like the others; the pressing
producer is a process of its own (tests/key_workers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from tests.fake_cuda import fake_torch as ft
from tests.fake_cuda.order_scenarios import _setup, mark

_PRESS = "import sys; from tests.key_workers import press; press(*sys.argv[1:])"


def _press(key: str, value: str) -> str:
    """Another producer's retained put of the feature's size under ``key``, each element ``value``, in
    a process of its own (after $FAKE_CUDA_SCENARIO_ACK's ack, if any); where it went ("pool" or
    "inline")."""
    run = subprocess.run([sys.executable, "-c", _PRESS, os.environ["MMFEAT_RUNTIME_DIR"], key, value,
                          os.environ["FAKE_CUDA_SCENARIO_NUMEL"], os.environ.get("FAKE_CUDA_SCENARIO_ACK", "")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def _queued(stream: Any, done: threading.Event, n: int) -> None:
    """Wait until ``n`` operations are queued on ``stream`` (the kernel and the copy behind it), or the
    get has returned."""
    deadline = time.monotonic() + 60
    while ft.pending(stream) < n and not done.is_set():
        assert time.monotonic() < deadline, "the get neither queued its copy nor returned"
        time.sleep(0.005)


def staged_get_by_key_under_pressure() -> None:
    """get(key=K, copy=True, device=0) of a host-pool feature found by key, its copy queued behind a
    kernel; then another producer puts a feature that needs K's space (a retained K nothing holds is
    evicted for it; a counted K is acked by its consumer first); then the kernel ends."""
    from mmfeat.client import Client, MmfeatError

    _setup()
    ft.land_copies()
    key, value = os.environ["FAKE_CUDA_SCENARIO_KEY"], float(os.environ["FAKE_CUDA_SCENARIO_VALUE"])
    with Client(timeout=20) as c:
        s = torch.cuda.Stream(0)
        ft.launch(s, "busy")
        result: list[Any] = []
        done = threading.Event()

        def get() -> None:
            with torch.cuda.stream(s):  # the current stream is the thread's own
                try:
                    result.append(c.get(key=key, copy=True, device=0))
                except MmfeatError as exc:
                    result.append(exc)
            done.set()

        # A get that waits for its copy waits for the kernel: in a thread of its own.
        t = threading.Thread(target=get)
        t.start()
        _queued(s, done, 2)
        mark(f"the other put went: {_press(os.environ['FAKE_CUDA_SCENARIO_OTHER'], '-1')}")
        ft.release("busy")
        t.join(60)
        ft.land()
        got = result[0]
        if isinstance(got, MmfeatError):
            mark(f"the get raised {got.code.value}")
        else:
            mark(f"the copy holds the feature's bytes: {bool((got == value).all())}")
        assert c.flush(20)


STAGED = {f.__name__: f for f in (staged_get_by_key_under_pressure,)}
