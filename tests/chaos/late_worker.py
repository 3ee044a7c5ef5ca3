"""A producer slower than its reservations, for the chaos run (tests/chaos/chaos.py), killed at random
like the others: it reserves one to three features, sleeps past their deadlines (reserve_ttl, as it was
when each lease was granted), and only then writes their bytes and publishes them.

The publish is expected to raise STALE. Its bytes are a constant, which no checked feature's pattern is, so if the
daemon had handed the range to another feature meanwhile, a consumer checking that feature would read
them and count a wrong read. Half its reservations are retained features without a key (their publish
path is the one keyed puts take), half counted features large enough for a reserved lease of their own
(an arena placement has no reserve_ttl). A publish the daemon takes after all (a daemon restarted since,
so the bytes went through put) is counted and its descriptor handed to nobody.

    python -m tests.chaos.late_worker RUNTIME_DIR RUN_DIR NAME SECONDS
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import torch

from mmfeat.client import Client, MmfeatError

from .worker import DEVICE, Counts

# What it writes late: a constant, where every feature a consumer checks follows its seed's pattern, so
# a late byte in any of them is a wrong read.
LATE_BYTE = 0xEE
# A counted feature larger than half the largest arena size class of a 256 MiB pool: a reserved lease.
COUNTED_BYTES = (17 << 20, 24 << 20)
RETAINED_BYTES = (1 << 10, 1 << 20)
# How far past its deadline it starts writing (the daemon's timer has then passed it as well), and how
# long it goes on: a feature placed in the range meanwhile and read while it writes shows its bytes.
PAST_DEADLINE_S = 0.2
WRITES, WRITE_EVERY_S = 6, 0.1


def late_produce(runtime_dir: str, run: Path, seconds: float) -> None:
    rng = random.Random(os.getpid())
    counts = Counts(run, "late")
    end = time.monotonic() + seconds
    with Client(runtime_dir, inline_threshold=0, timeout=2.0) as c:
        while time.monotonic() < end:
            # A few at once: a worker killed at random every few seconds still lives past some deadlines.
            held = []
            for _ in range(rng.randint(1, 3)):
                retained = rng.random() < 0.5
                nbytes = rng.randint(*(RETAINED_BYTES if retained else COUNTED_BYTES))
                device = DEVICE if DEVICE != "cpu" else None
                try:
                    if retained:
                        t = c.reserve((nbytes,), torch.uint8, device=device, retain_ttl=2.0)
                    else:
                        t = c.reserve((nbytes,), torch.uint8, consumers=1, device=device)
                except MmfeatError as exc:
                    counts.add(f"late_reserve_{exc.code.value if exc.code else 'unavailable'}")
                    continue
                if getattr(t, "_mmfeat_reservation").kind != "lease":
                    c.discard(t)  # no reserved lease (the pool full, the daemon down): nothing runs late
                    counts.add("late_no_lease")
                    continue
                held.append(t)
            if not held:
                time.sleep(0.05)
                continue
            last = max(getattr(t, "_mmfeat_reservation").deadline for t in held)
            time.sleep(max(0.0, last - time.monotonic()) + PAST_DEADLINE_S)
            for _ in range(WRITES):  # written late, and again: into whatever the ranges hold by now
                for t in held:
                    t.fill_(LATE_BYTE)
                time.sleep(WRITE_EVERY_S)
            for t in held:
                try:
                    c.publish(t)
                    counts.add("late_published")
                except MmfeatError as exc:
                    counts.add(f"late_refused_{exc.code.value if exc.code else 'unavailable'}")
            counts.flush()  # now: the next kill may come at any moment
    counts.flush()


def main() -> None:
    """A supervisor, as tests/chaos/worker.py's: forks the worker, writes its pid for the chaos driver
    to kill, and forks a new one each time it dies."""
    runtime_dir, run, name, seconds = sys.argv[1], Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    while True:
        pid = os.fork()
        if pid == 0:
            try:
                late_produce(runtime_dir, run, seconds)
            finally:
                os._exit(0)
        tmp = run / f"{name}.pid.tmp"
        tmp.write_text(str(pid))
        os.replace(tmp, run / f"{name}.pid")
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
