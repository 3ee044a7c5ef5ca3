"""A Client dropped without close() ends once it is collected: its threads, fds and daemon session go,
whatever it used (arenas, the background acker)."""

from __future__ import annotations

import gc
import os
import threading
import time

import torch

from mmfeat.client import Client, dumps, loads

from .conftest import Daemon, fd_count


def _settled(d: Daemon, threads: int, fds: int, clients: int, timeout: float = 10.0) -> None:
    """Back to the baseline: this process's threads and fds, the daemon's attached sessions."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        now = (threading.active_count(), fd_count(os.getpid()), d.stats()["clients"])
        if now[0] <= threads and now[1] <= fds and now[2] <= clients:
            return
        if time.monotonic() > deadline:
            names = sorted(t.name for t in threading.enumerate())
            raise AssertionError(f"threads, fds, attached sessions {now}, against {(threads, fds, clients)} "
                                 f"before the dropped Clients; threads: {names}")
        time.sleep(0.1)


def _baseline(d: Daemon) -> tuple[int, int, int]:
    gc.collect()
    return threading.active_count(), fd_count(os.getpid()), d.stats()["clients"]


def _drop(d: Daemon, use) -> None:
    c = Client(d.runtime_dir, timeout=5.0, inline_threshold=0, fallback="error")
    use(c)
    # Not closed: dropped here.


def test_clients_that_put_into_arenas_end_when_dropped_without_close(daemon) -> None:
    baseline = _baseline(daemon)
    for _ in range(20):
        _drop(daemon, lambda c: c.put(torch.arange(256, dtype=torch.float32)))
    _settled(daemon, *baseline)


def test_clients_whose_background_acker_ran_end_when_dropped_without_close(daemon_factory) -> None:
    """No arenas, so a Parcel's finaliser acks through the background thread."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "0")
    baseline = _baseline(d)

    def use(c: Client) -> None:
        parcel = loads(dumps({"x": torch.arange(4096, dtype=torch.float32)}, client=c), client=c)
        assert float(parcel.value["x"][5]) == 5.0
        del parcel  # its finaliser acks in the background
        c.flush()

    for _ in range(20):
        _drop(d, use)
    _settled(d, *baseline)
    d.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="every feature acked")
