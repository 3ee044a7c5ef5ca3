"""A reserve that will be refused evicts nothing: whatever can refuse it (the requester's quota, a pool
with no room even once every retained feature nothing holds is gone) is found before any eviction, so a
refused put never empties other sessions' caches for nothing."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

from mmfeat.client import ErrorCode, MmfeatError, Namespace

from . import eviction_workers, key_workers
from .conftest import Daemon
from .test_keys import books_balance

NS = Namespace(framework="vllm", version="0.32.0", model="Qwen/Qwen2-VL", dtype="bfloat16", prefix="evictions")
MIB = 1 << 20


def _run(children: Any, target: Any, *args: Any) -> Any:
    out = children.Queue()
    p = children.Process(target=target, args=(*args, out))
    p.start()
    result = out.get(timeout=90)
    p.join(30)
    assert p.exitcode == 0 and not (isinstance(result, tuple) and result[0] == "error"), result
    return result


def _evictions(d: Daemon) -> int:
    return d.stats()["counters"]["evictions"]


def test_a_put_refused_for_its_quota_or_for_room_evicts_no_other_sessions_feature(daemon_factory, children) -> None:
    """Seven retained features of another producer fill 14 of a 16 MiB pool. A put over the putter's
    max_session_mb is refused OVER_QUOTA, and one within it that no eviction could place (a hold keeps a
    feature in the middle of the pool, so no free range would be large enough) is refused POOL_FULL:
    neither evicts anything, and a reader process still reads all seven. A put that evicting makes room
    for still evicts, as before."""
    d = daemon_factory("--pool-mb", "16", "--max-session-mb", "15")
    keys = [NS.key(f"cached{i}") for i in range(7)]
    placed = _run(children, eviction_workers.put_retained, str(d.runtime_dir), keys, 2 * MIB)
    capacity = d.pool()["capacity"]
    refused_quota = _run(children, eviction_workers.put_refused, str(d.runtime_dir), NS.key("over"),
                         15 * MIB + MIB // 2)
    after_quota = _evictions(d)
    assert refused_quota == ("refused", "OVER_QUOTA"), refused_quota
    assert after_quota == 0, f"a put refused OVER_QUOTA evicted {after_quota} features of another session"
    # Hold the feature nearest the middle: once every other one were evicted, the largest free range
    # would be on either side of it.
    middle = min(range(7), key=lambda i: abs(placed[i][0] + MIB - capacity // 2))
    held_at = placed[middle][0]
    widest = max(held_at, capacity - held_at - 2 * MIB)
    q = children.Queue()
    holder = children.Process(target=key_workers.holder, args=(str(d.runtime_dir), keys[middle], 1, q))
    holder.start()
    try:
        assert q.get(timeout=60) is not None
        refused_room = _run(children, eviction_workers.put_refused, str(d.runtime_dir), NS.key("wide"),
                            widest + MIB // 4)
        after_room = _evictions(d)
        kept = _run(children, eviction_workers.read_keys, str(d.runtime_dir), keys)
        # Room that evictions do make: the put goes into the pool, evicting.
        fits = _run(children, eviction_workers.put_refused, str(d.runtime_dir), NS.key("fits"), 4 * MIB)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
    assert refused_room == ("refused", "POOL_FULL"), refused_room
    assert after_room == 0, f"a put refused POOL_FULL evicted {after_room} features first"
    assert kept == [True] * 7, kept
    assert fits == ("put",) and _evictions(d) > 0
    with d.client() as c:
        for k in (*keys, NS.key("fits")):
            c.evict(k)
    s = books_balance(d)
    assert s["counters"]["over_quota"] == 1 and s["counters"]["pool_full"] >= 1


def test_a_refused_reserve_evicts_no_retained_feature_of_an_arena_still_in_use(daemon_factory) -> None:
    """Retained features a producer placed in an arena it still places features in: their ranges are
    that producer's ring's, so evicting them gives the pool nothing. A reserve of another session that
    finds the pool full is refused POOL_FULL without evicting them, and they stay readable."""
    d = daemon_factory("--pool-mb", "16")
    keys = [NS.key(f"ringed{i}") for i in range(2)]
    with d.client(fallback="error") as producer, d.client() as hog:
        for i, k in enumerate(keys):  # 300 KiB each in a 1 MiB arena: the ring is not full
            producer.put(torch.full((75 << 10,), float(i)), key=k, retain_ttl=300.0, wait=False)
        taken = []
        with pytest.raises(MmfeatError) as e:
            while True:  # counted reservations, which no eviction frees, until the pool has no room
                taken.append(hog.request("reserve", session=hog.session.token, nbytes=256 << 10)["lease"])
        assert e.value.code is ErrorCode.POOL_FULL
        assert _evictions(d) == 0 and producer.has_many(keys) == [True, True]
        assert torch.equal(producer.get(key=keys[1], copy=True), torch.full((75 << 10,), 1.0))
        for lease in taken:
            hog.request("release", session=hog.session.token, lease=lease)
        assert all(producer.evict(k) for k in keys)
    books_balance(d)
