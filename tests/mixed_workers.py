"""Producers and consumers of the mixed run (tests/test_mixed_run.py), in separate processes (spawn).

Every feature is a slice of one 16 MiB random buffer that every process rebuilds from the same seed,
so a consumer checks every byte it gets against the slice the producer named, without a second copy
of the data travelling anywhere.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from mmfeat.client import Client

BASE_BYTES = 16 << 20
MIN_BYTES, MAX_BYTES = 64, 8 << 20
WINDOW = 8  # features one producer has in flight at most


def base() -> torch.Tensor:
    return torch.randint(0, 256, (BASE_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1234))


def produce(runtime_dir: str, rank: int, count: int, consumer_qs: list, done_q: Any, result_q: Any) -> None:
    torch.set_num_threads(1)
    data = base()
    rng = random.Random(rank)
    in_flight = 0
    stats = {"pool": 0, "inline": 0}
    with Client(runtime_dir, inline_threshold=0, name=f"producer{rank}") as c:
        for i in range(count):
            while in_flight >= WINDOW:
                in_flight -= done_q.get(timeout=60)
            size = int(math.exp(rng.uniform(math.log(MIN_BYTES), math.log(MAX_BYTES))))
            offset = rng.randrange(BASE_BYTES - size + 1)
            targets = rng.sample(range(len(consumer_qs)), rng.choice((1, 1, 2)))
            desc = c.put(data[offset : offset + size], consumers=len(targets))
            stats["inline" if desc.is_inline else "pool"] += 1
            blob = desc.to_bytes()
            for t in targets:
                consumer_qs[t].put((rank, blob, offset, size))
            in_flight += len(targets)
        while in_flight:
            in_flight -= done_q.get(timeout=60)
    for q in consumer_qs:
        q.put(None)
    result_q.put(("producer", rank, stats))


def consume(runtime_dir: str, rank: int, producers: int, my_q: Any, done_qs: list, result_q: Any) -> None:
    torch.set_num_threads(1)
    data = base()
    checked, bad, ended = 0, [], 0
    with Client(runtime_dir, name=f"consumer{rank}") as c:
        while ended < producers:
            item = my_q.get(timeout=120)
            if item is None:
                ended += 1
                continue
            producer, blob, offset, size = item
            got = c.get(blob, copy=bool(checked % 2))  # views and private copies both
            if got.numel() != size or not torch.equal(got, data[offset : offset + size]):
                bad.append((producer, offset, size))
            del got
            c.ack(blob)
            checked += 1
            done_qs[producer].put(1)
        assert c.flush(10.0)
    result_q.put(("consumer", rank, {"checked": checked, "bad": bad}))
