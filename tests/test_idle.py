"""An idle daemon sleeps: no timer wakes it many times a second, and a signal still wakes it at once."""

from __future__ import annotations

import os
import signal
import time

import torch

from .conftest import start_daemon


def _wakeups(pid: int) -> int:
    """Voluntary context switches of every thread: each one is a sleep that something ended."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total


def test_an_idle_daemon_sleeps_and_still_stops_on_a_signal(runtime_dir) -> None:
    d = start_daemon(runtime_dir, "--pool-mb", "8")
    try:
        with d.client() as c:  # one client came and went: nothing is live afterwards
            c.ack(c.put(torch.ones(100_000)))
        d.wait_for(lambda s: s["clients"] == 0 and s["pools"][0]["used"] == 0, what="the client to go")
        time.sleep(1.5)
        before = _wakeups(d.pid)
        time.sleep(3)
        woke = _wakeups(d.pid) - before
        # A sweep every 20 ms and a monitor poll every 25 ms made about 270 wake-ups in 3 s.
        assert woke <= 30, f"an idle daemon woke {woke} times in 3 s"
        d.proc.send_signal(signal.SIGHUP)  # handled in the loop it wakes, not a second later
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
        d.proc.communicate()
