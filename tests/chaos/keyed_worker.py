"""The keyed and retained processes of the chaos run (tests/chaos/chaos.py), killed at random like the
others: a producer that puts retained features under a small set of keys (so its puts often meet a
live key), and a holder that holds keys with a control-only client while a second client of its own
process reads the hold and acks it (another session, as a worker rank would). Each key's bytes follow
from the key, whoever put them, so every read is checked."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch

from mmfeat.client import Client, MmfeatError, Namespace

from .worker import Counts, feature

NAMESPACES = [Namespace("chaos", "1", f"model{i}", "uint8") for i in range(2)]
KEYS_PER_NAMESPACE = 48
RETAIN_TTL = 2.0


def key_of(ns: int, i: int) -> tuple[str, int, int]:
    """Key ``i`` of namespace ``ns``: the key, the seed of its bytes and their size (1 KiB to 2 MiB)."""
    return NAMESPACES[ns].key(f"item{i}"), 1_000_000 + ns * 1000 + i, 1 << (10 + i % 12)


def _random_key(rng: random.Random) -> tuple[str, int, int]:
    return key_of(rng.randrange(len(NAMESPACES)), rng.randrange(KEYS_PER_NAMESPACE))


def keyed_produce(runtime_dir: str, run: Path, seconds: float) -> None:
    rng = random.Random(os.getpid())
    counts = Counts(run, "keyed")
    end = time.monotonic() + seconds
    with Client(runtime_dir, timeout=2.0) as c:
        while time.monotonic() < end:
            key, seed, nbytes = _random_key(rng)
            t = feature(seed, nbytes, torch.uint8)
            try:
                if rng.random() < 0.3:
                    r = c.reserve(t.shape, t.dtype, key=key, retain_ttl=RETAIN_TTL)
                    r.copy_(t)
                    desc = c.publish(r)
                else:
                    desc = c.put(t, key=key, retain_ttl=RETAIN_TTL)
            except MmfeatError as exc:
                counts.add(f"put_error_{exc.code.value if exc.code else 'unavailable'}")
                time.sleep(0.05)
                continue
            counts.add("inline" if desc.is_inline else "keyed_put")
            time.sleep(rng.uniform(0, 0.01))


def _check(got: torch.Tensor, seed: int, nbytes: int, wrong: int, counts: Counts, what: str) -> None:
    if torch.equal(got.view(torch.uint8).cpu(), feature(seed, nbytes, torch.uint8).cpu()):
        counts.add("checked")
        counts.add("checked_bytes", nbytes)
    else:
        os.write(wrong, f"key seed {seed} nbytes {nbytes} {what}\n".encode())
        counts.add("wrong")


def hold_and_read(runtime_dir: str, run: Path) -> None:
    rng = random.Random(os.getpid())
    counts = Counts(run, "holder")
    wrong = os.open(run / "WRONG", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with Client(runtime_dir, timeout=2.0, map_pools=False) as scheduler, Client(runtime_dir, timeout=2.0) as rank:
        while True:
            key, seed, nbytes = _random_key(rng)
            try:
                if rng.random() < 0.3:
                    # No hold: a copying read checks again after copying, so it is right or refused.
                    _check(rank.get(key=key, copy=True), seed, nbytes, wrong, counts, "unheld copy")
                    continue
                hold = scheduler.hold(key, count=2)
                if hold is None:
                    counts.add("hold_missed")
                    time.sleep(0.005)
                    continue
                counts.add("held")
                for _ in range(rng.choice([0, 1, 2])):  # fewer than 2: the hold ends by ack_ttl or with us
                    _check(rank.get(hold, copy=rng.random() < 0.5), seed, nbytes, wrong, counts, "held")
                    rank.ack(hold, wait=rng.random() < 0.3)
            except MmfeatError as exc:
                counts.add(f"refused_{exc.code.value if exc.code else 'unavailable'}")
                time.sleep(0.05)  # a daemon that restarts is not hammered meanwhile
