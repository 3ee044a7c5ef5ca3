"""Keyed and retained puts that wait for nothing (``put(..., wait=False)``): placed in the producer's
arena and published by the table store like any feature, their key and lifetime bound by one quiet
``bind`` on the fd channel (SPEC.md, section 3, ``bind``). Against a real daemon, producers and
consumers in processes of their own where it matters."""

from __future__ import annotations

import signal
import subprocess
import sys

import torch

from mmfeat.client import Namespace

from . import key_workers
from .test_keys import books_balance

NS = Namespace(framework="vllm", version="0.32.0", model="Qwen/Qwen2-VL", dtype="bfloat16")
KIB = 1 << 10


def test_a_keyed_retained_put_waits_for_no_round_trip(daemon, children) -> None:
    """Once the session's arena is granted, keyed retained puts return while the daemon is stopped
    (anything they waited for would time out, and this producer raises instead of going inline); a
    consumer in another process then finds every key with its bytes, and the daemon reserved nothing."""
    keys = [NS.key(f"frozen{i}") for i in range(4)]
    with daemon.client(timeout=5.0, fallback="error") as producer:
        producer.put(torch.zeros(4096), key=NS.key("warm"), retain_ttl=300.0, wait=False)  # the arena's grant
        before = daemon.stats()["counters"]
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            descs = [producer.put(torch.full((4096,), float(i)), key=k, retain_ttl=300.0, wait=False)
                     for i, k in enumerate(keys)]
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert not any(d.is_inline for d in descs)
        q = children.Queue()
        reader = children.Process(target=key_workers.key_reader, args=(str(daemon.runtime_dir), keys, q))
        reader.start()
        assert q.get(timeout=120) == [(float(i), True) for i in range(len(keys))]
        reader.join(30)
        after = daemon.stats()["counters"]
        assert after["reserves"] == before["reserves"] == 0 and after["binds"] - before["binds"] == len(keys)
        assert after["arena_publishes"] - before["arena_publishes"] == len(keys)
        assert producer.async_failures == {}
        assert all(producer.evict(k) for k in (*keys, NS.key("warm")))
    books_balance(daemon)


def test_a_consumer_finds_each_key_the_moment_its_put_returned(daemon, children) -> None:
    """A consumer told of each key as soon as its put returned (as a consumer learns of an item once the
    producer's request ended) finds it, with its bytes, every time: the daemon reads what waits on its
    fd channels before it answers a lookup that would miss. Counted ones end with their consumer's ack."""
    keys = [NS.key(f"stream{i}") for i in range(40)]
    counted = [i % 3 == 0 for i in range(len(keys))]
    keys_q, out_q = children.Queue(), children.Queue()
    rt = str(daemon.runtime_dir)
    consumer = children.Process(target=key_workers.streaming_consumer, args=(rt, keys_q, out_q))
    producer = children.Process(target=key_workers.streaming_producer, args=(rt, keys, counted, keys_q))
    consumer.start()
    producer.start()
    found = out_q.get(timeout=180)
    producer.join(30)
    consumer.join(30)
    assert producer.exitcode == consumer.exitcode == 0
    assert found == [(k, True) for k in keys]
    with daemon.client() as c:
        assert c.has_many(keys) == [not one for one in counted]  # the counted ones ended with their ack
        s = c.stats()
        assert s["counters"]["reserves"] == 0 and s["counters"]["binds"] == len(keys)
        assert all(c.evict(k) for k, one in zip(keys, counted) if not one)
    books_balance(daemon)


def test_a_hold_many_sent_behind_binds_the_daemon_has_not_read_finds_the_last_key(daemon, children) -> None:
    """The vLLM scheduler holds a request's items with hold_many as soon as the producer's put returned.
    Here the daemon is stopped while the producer queues more binds than the daemon reads from one
    connection at a time, and the hold_many of the last key is sent behind them: the daemon finds that
    request ready before it has read the last bind, and must read the binds first, as for a lookup."""
    keys = [NS.key(f"backlog{i}") for i in range(100)]  # above 64, the binds read per connection per turn
    ready_q, go_q, out_q = children.Queue(), children.Queue(), children.Queue()
    holder = children.Process(target=key_workers.late_holder,
                              args=(str(daemon.runtime_dir), keys[-1], ready_q, go_q, out_q))
    holder.start()
    assert ready_q.get(timeout=120) == "connected"
    with daemon.client(timeout=60.0, fallback="error") as producer:
        producer.put(torch.zeros(4), key=NS.key("warm"), retain_ttl=300.0, wait=False)  # the arena's grant
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            for i, k in enumerate(keys):
                producer.put(torch.full((4,), float(i)), key=k, retain_ttl=300.0, wait=False)
            go_q.put("go")
            assert ready_q.get(timeout=120) == "sending"
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert out_q.get(timeout=120), "hold_many missed a key whose put had returned before it was sent"
        holder.join(30)
        assert holder.exitcode == 0
        assert all(producer.evict(k) for k in (*keys, NS.key("warm")))
    books_balance(daemon)


_DIES_AT_BIND = """
import os, signal, sys, torch
from mmfeat.client import Client
c = Client(sys.argv[1], fallback="error")
fd = c.session.fd
send = fd.send
def send_or_die(op, *args, **fields):
    if op == "bind":
        os.kill(os.getpid(), signal.SIGKILL)  # the feature is stored in the table; its bind is never sent
    return send(op, *args, **fields)
fd.send = send_or_die
c.put(torch.ones(4096), key=sys.argv[2], retain_ttl=300.0, wait=False)
"""

_DIES_AFTER_PUT = """
import os, signal, sys, torch
from mmfeat.client import Client
c = Client(sys.argv[1], fallback="error")
c.put(torch.full((4096,), 7.0), key=sys.argv[2], retain_ttl=300.0, wait=False)
os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush: dead the moment put returned
"""


def test_a_producer_killed_between_its_store_and_its_bind_leaves_nothing(daemon) -> None:
    """Killed after the table store that publishes a retained feature and before its bind: the feature
    is adopted awaiting its bind, which never comes, and ends with the session; nothing is refused and
    nothing is left. Killed right after put returned: its bind was in the daemon's socket buffer, so the
    feature is kept and found by its key."""
    rt = str(daemon.runtime_dir)
    lost, kept = NS.key("lost"), NS.key("kept")
    for code, key in ((_DIES_AT_BIND, lost), (_DIES_AFTER_PUT, kept)):
        run = subprocess.run([sys.executable, "-c", code, rt, key], capture_output=True, text=True, timeout=120)
        assert run.returncode == -signal.SIGKILL, run.stderr
    s = daemon.wait_for(lambda s: s["clients"] == 0, timeout=30, what="both producers' sessions to end")
    assert s["counters"]["reclaimed_on_disconnect"] == 1 and s["counters"]["bad_table_words"] == 0
    assert s["counters"]["binds"] == 1 and s["counters"]["reserves"] == 0 and s["leases"]["PUBLISHED"] == 1
    with daemon.client() as c:
        assert c.has_many([lost, kept]) == [False, True]
        assert torch.equal(c.get(key=kept, copy=True), torch.full((4096,), 7.0))
        assert c.evict(kept)
    s = books_balance(daemon)
    assert s["pools"][0]["used"] == 0  # both sessions' arenas went back with their last feature


def test_a_pipelined_put_under_a_live_key_leaves_the_key_to_the_first(daemon) -> None:
    """The key keeps naming the feature first published under it; the later put's own feature stays
    readable by the descriptor it returned, for its own lifetime, found by no key."""
    retained, counted = NS.key("first-retained"), NS.key("first-counted")
    with daemon.client(fallback="error") as p, daemon.client() as c:
        first = p.put(torch.ones(4096), key=retained, retain_ttl=300.0)  # reserved, and waited for
        late = p.put(torch.zeros(4096), key=retained, retain_ttl=300.0, wait=False)
        also = p.put(torch.full((4096,), 2.0), key=retained, retain_ttl=300.0, wait=False)
        assert c.lookup(retained).to_bytes() == first.to_bytes()
        assert len({first.lease, late.lease, also.lease}) == 3
        assert torch.equal(c.get(late, copy=True), torch.zeros(4096))
        assert torch.equal(c.get(also, copy=True), torch.full((4096,), 2.0))
        d1 = p.put(torch.ones(4096), key=counted, consumers=1, wait=False)
        d2 = p.put(torch.zeros(4096), key=counted, consumers=1, wait=False)
        assert c.lookup(counted).to_bytes() == d1.to_bytes()
        for d, value in ((d1, 1.0), (d2, 0.0)):
            assert torch.equal(c.get(d, copy=True), torch.full((4096,), value))
            c.ack(d)
        c.flush()
        assert not c.has(counted)
        s = c.stats()
        assert s["counters"]["dedups"] == 3 and s["namespaces"][NS.id]["dedups"] == 3
        assert s["counters"]["binds"] == 4 and s["leases"]["PUBLISHED"] == 3
        assert p.async_failures == {}
        assert c.evict(retained)
        # The unkeyed ones are their producer's to let go (else their retain_ttl or the pool's need ends them).
        for d in (late, also):
            p.request("release", session=p.session.token, lease=d.lease_ref())
    books_balance(daemon)


def test_an_unkeyed_retained_put_outlives_its_producer_and_its_readers_acks(daemon) -> None:
    with daemon.client(fallback="error") as producer:
        desc = producer.put(torch.ones(10000), retain_ttl=1.0, wait=False)
    with daemon.client() as reader:
        for _ in range(3):
            assert torch.equal(reader.get(desc, copy=True), torch.ones(10000))
            reader.ack(desc)  # counts nothing: it stays
        reader.flush()
        assert reader.request("lookup", lease=desc.lease_ref())["state"] == "PUBLISHED"
    s = books_balance(daemon)  # then its retain_ttl ends it
    assert s["counters"]["retained_expired"] == 1 and s["counters"]["retained_acks"] == 3
    assert s["counters"]["binds"] == 1 and s["counters"]["reserves"] == 0


def test_an_evicted_retained_feature_gives_its_space_back_to_its_producers_ring(daemon_factory) -> None:
    """A ring a live retained feature blocks would take nothing more: its arena goes back when a feature
    finds no room there. One evicted (or expired) gives the ring its space back: nothing goes back."""
    d = daemon_factory("--pool-mb", "16")  # arenas of 1 MiB: three of these features fill one
    with d.client(fallback="error") as p:
        for i in range(3):
            p.put(torch.full((75 * KIB,), float(i)), key=NS.key(f"ring{i}"), retain_ttl=300.0, wait=False)
        assert all(p.evict(NS.key(f"ring{i}")) for i in range(3))
        for i in range(3, 9):
            p.put(torch.full((75 * KIB,), float(i)), key=NS.key(f"ring{i}"), retain_ttl=300.0, wait=False)
            if i == 5:
                # Three live in the one ring, all its space in use: unlike before, nothing came back to it.
                assert p.stats()["counters"]["arenas_returned"] == 0
        s = p.stats()
        assert s["counters"]["arenas_returned"] >= 1 and s["counters"]["reserves"] == 0
        assert p.has_many([NS.key(f"ring{i}") for i in range(3, 9)]) == [True] * 6
        assert all(p.evict(NS.key(f"ring{i}")) for i in range(3, 9))
    books_balance(d)


def test_pressure_evicts_retained_features_of_returned_arenas_never_a_held_one(daemon_factory) -> None:
    """Retained features fill every arena and the pool: the arenas they block go back, new features
    take new arenas and then reserves, the oldest features nothing holds are evicted (their ranges, and
    whole arenas, coming back to the pool), no put goes inline, and the held one stays readable."""
    d = daemon_factory("--pool-mb", "16")
    keys = [NS.key(f"press{i}") for i in range(70)]  # 70 x 300 KiB: more than the 16 MiB pool
    with d.client(fallback="error") as p, d.client(map_pools=False) as scheduler:
        p.put(torch.full((75 * KIB,), 0.0), key=keys[0], retain_ttl=300.0, wait=False)
        hold = scheduler.hold(keys[0], count=1)
        assert hold is not None
        for i, k in enumerate(keys[1:], 1):
            assert not p.put(torch.full((75 * KIB,), float(i)), key=k, retain_ttl=300.0, wait=False).is_inline
        s = p.stats()
        c = s["counters"]
        assert c["arenas_returned"] >= 1 and c["arenas_freed"] >= 1 and c["evictions"] >= 1
        assert c["fallbacks"] == {} and p.async_failures == {}
        live = p.has_many(keys)
        assert live[0] and live[-1] and not all(live)
        assert torch.equal(p.get(hold, copy=True), torch.zeros(75 * KIB))
        p.ack(hold)
        p.flush()
        for k, there in zip(keys, live):
            if there:
                assert p.evict(k)
    books_balance(d)


def test_a_feature_no_arena_takes_is_reserved_under_no_key_and_bound_after_its_publish(daemon_factory) -> None:
    """A feature whose arena would pass an eighth of the pool is reserved (the one round trip such a put
    waits for), published pipelined and bound by key behind its publish: found by key at once, and under
    a live key left unkeyed and readable, as in an arena."""
    d = daemon_factory("--pool-mb", "16")  # arenas of at most 2 MiB: a 1.5 MiB feature's class is 4 MiB
    key, numel = NS.key("large"), 384 * KIB
    with d.client(fallback="error") as p, d.client() as c:
        first = p.put(torch.ones(numel), key=key, retain_ttl=300.0, wait=False)
        again = p.put(torch.zeros(numel), key=key, retain_ttl=300.0, wait=False)
        assert c.lookup(key).to_bytes() == first.to_bytes() and again.lease != first.lease
        assert torch.equal(c.get(key=key, copy=True), torch.ones(numel))
        assert torch.equal(c.get(again, copy=True), torch.zeros(numel))
        s = c.stats()["counters"]
        assert s["reserves"] == 2 and s["binds"] == 2 and s["dedups"] == 1 and s["arena_publishes"] == 0
        assert p.async_failures == {}
        assert c.evict(key)
        p.request("release", session=p.session.token, lease=again.lease_ref())
    books_balance(d)


def test_stats_count_a_bind_sent_before_they_were_asked(daemon) -> None:
    """Stats promise to be exact as of their reply: a bind the client sent (without waiting) before it
    asked is counted, however the daemon orders its sockets. The daemon is stopped while both wait, so
    both are ready at once when it runs again."""
    with daemon.client(timeout=30.0, fallback="error") as producer:
        producer.put(torch.zeros(1024), key=NS.key("grant"), retain_ttl=300.0, wait=False)  # the arena's grant
        assert producer.has(NS.key("grant"))  # its bind read: the lookup reads what waits first
        before = producer.stats()["counters"]["binds"]
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            producer.put(torch.ones(1024), key=NS.key("counted"), retain_ttl=300.0, wait=False)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert producer.stats()["counters"]["binds"] == before + 1
        assert all(producer.evict(NS.key(k)) for k in ("grant", "counted"))
    books_balance(daemon)


def test_a_scheduler_holding_keys_finds_a_put_that_returned_before_it_asked(daemon) -> None:
    """``hold_many`` (the vLLM scheduler's one round trip) finds a key whose pipelined put returned before
    it asked, as lookups do: the daemon, stopped while the bind waits on the producer's fd channel, sees
    the bind and the hold ready at once when it runs again."""
    key = NS.key("scheduled")
    with daemon.client(timeout=30.0, fallback="error") as producer, \
            daemon.client(timeout=30.0, map_pools=False) as scheduler:
        producer.put(torch.zeros(1024), key=NS.key("grant"), retain_ttl=300.0, wait=False)  # the arena's grant
        warm = scheduler.hold_many([NS.key("grant")], count=1)  # its session open before the stop
        assert warm[0] is not None
        scheduler.ack(warm[0][0])
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            producer.put(torch.ones(1024), key=key, retain_ttl=300.0, wait=False)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        found = scheduler.hold_many([key], count=1)
        assert found[0] is not None and found[0][1] is True
        scheduler.ack(found[0][0])
        assert all(producer.evict(NS.key(k)) for k in ("grant", "scheduled"))
    books_balance(daemon)
