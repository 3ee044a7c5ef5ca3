"""The staged GPU consumer of the chaos run (tests/chaos/chaos.py --staged N), killed at random like the
others: it reads retained features by key into a GPU's memory, each copied from the host pool's pinned
pages on the device's stream with no host wait (client/consume/pinned.py), while the keyed producers'
puts evict the retained features nothing holds to make room in a small pool. Every copy is queued behind
GPU work of a random length, so its DMA runs after get returned and after the read's hold was acked
behind it: a range given back, evicted or rewritten before its copy ran reads as a wrong byte.

Half the reads are ``get(key=..., device=0)`` (the get holds the feature for its copy and acks that hold
behind it), half a hold taken by a control-only client and read through by a second client of the
process, which acks the hold at once (the ack, not the caller, waits for the copy).

Where torch has no CUDA it runs on the fake driver (tests/fake_cuda), whose streams copy host memory when
they reach the copy, as a DMA does, and whose "kernels" end when a timer releases them; chaos.py builds
that driver and puts it on LD_LIBRARY_PATH, with STUB_LOG where the driver logs its calls.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import torch

from mmfeat.client import Client, MmfeatError

from .keyed_worker import _random_key
from .worker import Counts, feature

# A fake stream keeps every operation it was given (tests/fake_cuda/fake_libcuda.c, MAXOPS): a process
# stops after this many batches of at most 5 and its supervisor forks the next.
BATCHES = 300
MAX_BUSY_S = 0.25  # the GPU work each batch's copies queue behind
DRAIN_S = 30.0  # a stream that has not run its batch by then is a hang, and counted so


class _Gpu:
    """GPU work of a given length on a stream, and a wait for the stream to run dry: the real device's,
    or the fake driver's (a kernel a timer releases)."""

    def __init__(self) -> None:
        self.fake = not torch.cuda.is_available()
        if self.fake:
            from tests.fake_cuda import fake_torch
            from tests.fake_cuda.order_scenarios import _setup

            _setup()
            fake_torch.land_copies()
            self._ft = fake_torch
        self._tags = itertools.count()

    def busy(self, stream: Any, seconds: float) -> None:
        if not self.fake:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(seconds * 1e9))  # about a second's cycles at 1 GHz
            return
        tag = f"busy-{os.getpid()}-{next(self._tags)}"
        self._ft.launch(stream, tag)
        timer = threading.Timer(seconds, self._ft.lib().fake_release, [tag.encode()])
        timer.daemon = True
        timer.start()

    def drained(self, stream: Any, timeout: float) -> bool:
        if not self.fake:
            stream.synchronize()
            return True
        deadline = time.monotonic() + timeout
        while self._ft.pending(stream):  # the fake runs its queues as it is called
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        self._ft.land()
        return True


def _check(got: torch.Tensor, seed: int, nbytes: int, wrong: int, counts: Counts, how: str) -> None:
    if torch.equal(got.view(torch.uint8).cpu(), feature(seed, nbytes, torch.uint8).cpu()):
        counts.add("staged_checked")
        counts.add("staged_bytes", nbytes)
    else:
        os.write(wrong, f"staged read ({how}) of key seed {seed} nbytes {nbytes}: not the key's bytes\n".encode())
        counts.add("wrong")


def staged_read(runtime_dir: str, run: Path) -> None:
    gpu = _Gpu()
    rng = random.Random(os.getpid())
    counts = Counts(run, "staged")
    wrong = os.open(run / "WRONG", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with Client(runtime_dir, timeout=2.0, map_pools=False) as scheduler, Client(runtime_dir, timeout=2.0) as rank:
        stream = torch.cuda.Stream(0)
        for _ in range(BATCHES):
            gpu.busy(stream, rng.uniform(0, MAX_BUSY_S))
            reads = []
            with torch.cuda.stream(stream):
                for _ in range(rng.randint(1, 4)):
                    key, seed, nbytes = _random_key(rng)
                    try:
                        if rng.random() < 0.5:
                            reads.append((rank.get(key=key, device=0), seed, nbytes, "by key"))
                            continue
                        hold = scheduler.hold(key)
                        if hold is None:
                            counts.add("hold_missed")
                            continue
                        counts.add("held")
                        reads.append((rank.get(hold, device=0), seed, nbytes, "through a hold"))
                        rank.ack(hold)  # before the copy ran: the ack waits for it
                    except MmfeatError as exc:
                        counts.add(f"refused_{exc.code.value if exc.code else 'unavailable'}")
                        if exc.code is None:
                            time.sleep(0.05)  # a daemon that restarts is not hammered meanwhile
            if not gpu.drained(stream, DRAIN_S):
                os.write(wrong, f"staged reads: the stream did not run its copies in {DRAIN_S:g} s\n".encode())
                counts.add("wrong")
                break
            for got, seed, nbytes, how in reads:
                _check(got, seed, nbytes, wrong, counts, how)
            counts.add("staged_batches")
    counts.flush()
