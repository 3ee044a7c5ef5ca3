"""The shared-memory path: put, get and ack with no message to the daemon, and every guarantee kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from mmfeat import atomics
from mmfeat.protos import ErrorCode, MmfeatError

from .conftest import run_ready_child
from .ttls import ran_out, sleep_until, ttls


def _no_features(s: dict) -> bool:
    return s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}


def _consistent(pool: dict) -> bool:
    """Every byte in use belongs to a lease outside an arena or to an arena (SPEC.md, section 5)."""
    in_leases = sum(pool["bytes"].values())
    a = pool["arenas"]
    return pool["used"] == in_leases - a["live_bytes"] + a["bytes"] and a["slack"] <= a["bytes"]


def test_put_get_and_ack_need_no_daemon(daemon) -> None:
    """Once the arena is granted, a frozen daemon does not slow put, get or ack: none of them sends it
    anything (a message would time out, and this producer raises instead of going inline). The timeouts
    are short, but not so short that a loaded machine's daemon misses them before and after the freeze."""
    with daemon.client(inline_threshold=0, timeout=2.0, fallback="error") as producer, \
            daemon.client(timeout=2.0) as consumer:
        warm = producer.put(torch.zeros(1000))  # the arena is granted here, and the consumer connects
        consumer.get(warm)
        consumer.ack(warm)
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            for k in range(100):  # 6.4 MiB: inside the first arena (a sixteenth of the 128 MiB pool)
                x = torch.full((16384,), float(k))
                desc = producer.put(x, consumers=2)
                assert torch.equal(consumer.get(desc), x)
                consumer.ack(desc, count=2)
            assert time.monotonic() - t0 < 10
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        s = daemon.wait_for(_no_features, what="the sweep to apply the table acks")
        assert s["counters"]["arena_publishes"] == 101 and s["counters"]["reserves"] == 0
        assert s["counters"]["table_acks"] == 201 and s["counters"]["frees"] == 101
        assert s["counters"]["bad_table_words"] == 0 and _consistent(s["pools"][0])
    assert daemon.pool()["used"] == 0


def test_the_last_ack_hands_the_space_back_before_the_daemon_sweeps(daemon) -> None:
    """The consumer whose ack completes the count marks the feature DONE in the table, and the producer
    reuses its space at once: with the daemon frozen (no sweep, no FREE), fifty features go through one
    range, each in a slot of its own (a slot comes back only once the daemon wrote FREE). A reader of a
    DONE feature is never handed the bytes now there: it asks the daemon, which says the feature ended."""
    with daemon.client(inline_threshold=0, timeout=2.0, fallback="error") as producer, \
            daemon.client(timeout=2.0) as consumer:
        warm = producer.put(torch.zeros(16384))
        consumer.get(warm)
        consumer.ack(warm)
        daemon.wait_for(_no_features, what="the warm-up feature to end")
        descs = []
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            for k in range(50):
                x = torch.full((16384,), float(k))
                desc = producer.put(x, consumers=2)
                assert torch.equal(consumer.get(desc), x)
                consumer.ack(desc)
                consumer.ack(desc)  # the second ack completes the count: DONE
                descs.append(desc)
            assert len({d.offset for d in descs}) == 1, "the producer waited for the daemon to reuse space"
            assert len({d.lease for d in descs}) == 50
            with pytest.raises(MmfeatError):  # DONE: only the (frozen) daemon may say more
                consumer.get(descs[0])
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        with pytest.raises(MmfeatError) as info:
            consumer.get(descs[-1])
        assert info.value.code is ErrorCode.NOT_FOUND and "acks" in info.value.message
        s = daemon.wait_for(_no_features, what="the sweep to end the DONE features")
        assert s["counters"]["arena_publishes"] == 51 and s["counters"]["table_acks"] == 101
        assert s["counters"]["frees"] == 51 and s["counters"]["over_acks"] == 0
        assert s["counters"]["bad_table_words"] == 0 and _consistent(s["pools"][0])
        # Every slot came back with FREE: the next feature takes the first free one again.
        last = producer.put(torch.ones(16384))
        assert last.lease in {d.lease for d in descs} | {warm.lease}
        consumer.ack(last)
        daemon.wait_for(_no_features, what="the last feature to end")
    assert daemon.pool()["used"] == 0


def test_a_ring_whose_oldest_ack_lags_keeps_placing_in_its_arena(daemon_factory) -> None:
    """A producer with a few features in flight whose consumer acks late (a background acker) finds
    room in the arena it uses: its ring goes back to the arena's start only once the start holds what is
    in flight, so a lagging ack does not fill a ring wrapped into one feature's room and send the
    producer to a second arena (or a reserve) with this one nearly empty."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "1")
    with d.client(inline_threshold=0, fallback="error") as c:
        x = [torch.full((16 * 1024,), float(k)) for k in range(6)]  # 64 KiB each, 16 to the arena
        a, b = c.put(x[0]), c.put(x[1])
        c.ack(a)  # the oldest ends; b is still being read, and its consumer's ack lags
        later = [c.put(t) for t in x[2:]]
        s = d.stats()
        assert s["counters"]["reserves"] == 0 and s["counters"]["arenas_granted"] == 1, s["counters"]
        assert len({desc.offset for desc in [b, *later]}) == 5
        for k, desc in enumerate([b, *later], start=1):
            assert torch.equal(c.get(desc), x[k])
            c.ack(desc)
        assert c.flush()
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the arena to go back")


def test_a_burst_of_small_features_asks_ahead_by_slots(daemon_factory) -> None:
    """Small features run an arena out of slots long before its bytes: the next arena is asked for
    once half the slots hold live features, so the burst reserves nothing at the turnover."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "1", "--arena-slots", "16", "--arenas-per-session", "8")
    with d.client(inline_threshold=0, fallback="error") as c:
        held = []
        for k in range(16 * 4):  # 4 KiB each: four arenas' slots, a sixteenth of their bytes
            held.append(c.put(torch.full((1024,), float(k))))
            assert c.session.fd.sync(10.0)  # as in the burst test: the machine's speed taken out of it
        s = d.stats()["counters"]
        assert s["reserves"] == 0 and s["arena_publishes"] == 64 and s["arenas_granted"] >= 4, s
        for k, desc in enumerate(held):
            assert torch.equal(c.get(desc), torch.full((1024,), float(k)))
            c.ack(desc)
        assert c.flush()
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the arenas to go back")


def test_group_acks_cache_hits_and_over_acks_in_the_table(daemon) -> None:
    with daemon.client(inline_threshold=0) as c:
        d = c.put(torch.ones(4096), consumers=4)
        c.ack(d, count=2)  # a group of two
        c.ack(d)  # a cache hit that never read
        assert c.flush()
        assert daemon.pool()["leases"]["PUBLISHED"] == 1
        c.ack(d, count=3)  # one more than remain: clamped and counted
        s = daemon.wait_for(_no_features, what="the last ack")
        assert s["counters"]["acks"] == 4 and s["counters"]["over_acks"] == 2 and s["counters"]["frees"] == 1
        # A late ack of the ended feature does not reach its slot's next tenant.
        reused = c.put(torch.zeros(4096), consumers=1)
        assert (reused.lease, reused.gen) == (d.lease, d.gen + 1)
        with pytest.raises(MmfeatError) as info:
            c.ack(d)  # this client acked it already: refused at the call, nothing sent
        assert info.value.code is ErrorCode.STALE and "already acked" in info.value.message
        with daemon.client() as late:  # one that never acked it: the table refuses, the daemon says why
            late.ack(d)
            assert late.flush()
            assert late.async_failures == {"ack STALE": 1}
        assert daemon.pool()["leases"]["PUBLISHED"] == 1
        with pytest.raises(MmfeatError) as info:
            c.ack(d, wait=True)
        assert info.value.code is ErrorCode.STALE
        with pytest.raises(MmfeatError) as info:
            c.get(d)
        assert info.value.code is ErrorCode.STALE
        assert torch.equal(c.get(reused), torch.zeros(4096))
        c.ack(reused)
    s = daemon.stats()
    assert s["pools"][0]["used"] == 0 and s["counters"]["frees"] == 2


_PRODUCER = """
import os, signal, sys, torch
from mmfeat.client import Client
c = Client(sys.argv[1], inline_threshold=0, fallback="error")
for k in range(6):
    d = c.put(torch.full((65536,), float(k)), consumers=1)
    os.write(1, d.to_bytes().hex().encode() + b"\\n")
os.kill(os.getpid(), signal.SIGKILL)  # no close: its arena still holds six unread features
"""


def test_a_killed_producers_features_stay_readable_and_its_arena_is_trimmed(daemon) -> None:
    out = subprocess.run([sys.executable, "-c", _PRODUCER, str(daemon.runtime_dir)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr
    blobs = [bytes.fromhex(line) for line in out.stdout.split()]
    assert len(blobs) == 6
    s = daemon.wait_for(lambda s: s["clients"] == 0, what="the dead producer's session to end")
    pool = s["pools"][0]
    # Its unpublished space went back at once; what is left is exactly its six features.
    assert pool["leases"]["PUBLISHED"] == 6 and pool["used"] == 6 * 256 * 1024 and pool["arenas"]["slack"] == 0
    assert _consistent(pool)
    with daemon.client(inline_threshold=0) as other, daemon.client() as consumer:
        fillers = [other.put(torch.full((65536,), -1.0)) for _ in range(6)]  # must not land on them
        for k, blob in enumerate(blobs):
            assert torch.equal(consumer.get(blob), torch.full((65536,), float(k)))
            consumer.ack(blob)
        for f in fillers:
            other.ack(f)
    s = daemon.stats()
    assert s["pools"][0]["used"] == 0 and s["counters"]["arenas_freed"] == s["counters"]["arenas_granted"]


def test_a_killed_consumers_share_expires(daemon_factory) -> None:
    for ttl in ttls(3.0):
        d = daemon_factory("--pool-mb", "64", "--ack-ttl", str(ttl))
        with d.client(inline_threshold=0) as producer:
            made = []

            def put() -> bytes:
                made.append((time.monotonic(), producer.put(torch.ones(65536), consumers=2)))
                return made[0][1].to_bytes()

            out = run_ready_child("c.get(arg); c.ack(arg); os.kill(os.getpid(), signal.SIGKILL)", d.runtime_dir, put)
            put_at, desc = made[0]
            if not ran_out(out.stderr, put_at, ttl):
                assert out.returncode == -signal.SIGKILL, out.stderr
                # One ack arrived through the table before the kill; the second never comes: ack_ttl frees it.
                s = d.wait_for(lambda s: s["counters"]["expired"] == 1, what="ack_ttl")
                assert s["counters"]["acks"] == 1 and _no_features(s)
                with pytest.raises(MmfeatError) as info:
                    producer.get(desc)
                assert info.value.code is ErrorCode.NOT_FOUND and "ack_ttl" in info.value.message
                return
        assert d.stop() == 0  # the child read only after ack_ttl: again, with a longer one
    pytest.fail(f"the child read after ack_ttl {ttl} s too: {out.stderr}")


def test_a_consumer_that_never_acks_stalls_nothing_past_ack_ttl(daemon_factory) -> None:
    """A ring arena reclaims in order, so one feature nobody acks holds back the space after it; ack_ttl
    bounds that, and the producer keeps placing features in arenas the whole time."""
    d = daemon_factory("--pool-mb", "64", "--ack-ttl", "0.4", "--arena-mb", "1")
    with d.client(inline_threshold=0, fallback="error") as producer, d.client() as consumer:
        # A count, not a time: a loaded machine must still go round each 1 MiB arena several times.
        n = 0
        started = time.monotonic()
        put_at = []
        while n < 160 or time.monotonic() - started < 1.5:
            put_at.append(time.monotonic())
            desc = producer.put(torch.full((16384,), float(n)), consumers=2)  # 64 KiB
            try:
                got = consumer.get(desc)
            except MmfeatError as exc:  # a loaded machine stalled this thread past ack_ttl since the put
                assert exc.code is ErrorCode.NOT_FOUND and time.monotonic() - put_at[-1] > 0.4, exc
            else:  # nothing can write over it meanwhile: only this thread puts
                assert torch.equal(got, torch.full((16384,), float(n)))
                consumer.ack(desc)  # the second consumer never acks
            n += 1
            time.sleep(0.01)
        s = d.stats()  # it sweeps: each feature put so far is seen now, its ack_ttl running at the latest
        seen = time.monotonic()
        # Each 1 MiB arena holds 16 of these, and a session holds at most 4 arenas: the producer kept
        # placing features in arenas only because expiry gave their space back.
        assert s["counters"]["expired"] > 0 and s["counters"]["arena_publishes"] > max(64, n // 2)
        # Once ack_ttl has passed since that sweep, by the daemon's clock and ours, the next sweep has
        # ended them all, however late a busy machine ran either.
        sleep_until(seen + 0.4)
        s = d.stats()
        assert s["leases"]["PUBLISHED"] == 0 and s["counters"]["expired"] == n  # one ack each of two
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the last features to expire")


def test_an_idle_producer_gives_its_arena_back(daemon, monkeypatch) -> None:
    from mmfeat.client.link import arenas

    monkeypatch.setattr(arenas, "IDLE_S", 0.4)
    with daemon.client(inline_threshold=0) as c:
        c.ack(c.put(torch.ones(4096)))
        # A counter, not the arena count: a stats call can take longer than IDLE_S on a loaded machine.
        assert daemon.stats()["counters"]["arenas_granted"] == 1
        s = daemon.wait_for(lambda s: s["pools"][0]["arenas"]["count"] == 0, what="the idle arena to go back")
        assert s["pools"][0]["used"] == 0 and s["counters"]["arenas_returned"] == 1
        desc = c.put(torch.ones(4096))  # asks for a new arena, which the next put would take
        assert not desc.is_inline
        daemon.wait_for(lambda s: s["counters"]["arenas_granted"] == 2 and s["pools"][0]["arenas"]["count"] == 1,
                        what="the new arena")
        c.ack(desc)


def test_a_draining_daemon_turns_producers_away_from_their_arenas(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "64", "--drain-timeout", "5")
    with d.client(inline_threshold=0) as c:
        held = c.put(torch.ones(4096))  # keeps the drain going
        d.proc.send_signal(signal.SIGTERM)
        d.wait_for(lambda s: s["draining"], what="the drain")
        late = c.put(torch.ones(4096))
        assert late.is_inline and c.fallbacks["draining"] == 1
        c.ack(held)
    assert d.proc.wait(10) == 0


def test_a_producer_asks_for_its_next_arena_before_the_first_fills(daemon_factory) -> None:
    """Once an arena is over half full, a put asks for the next one without waiting, so the put that
    finds the first arena full goes to the second instead of reserving: puts that keep landing in the
    arena that had room (placement's fast path) ask as the others do."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "1")
    with d.client(inline_threshold=0, fallback="error") as c:
        held = [c.put(torch.full((16 * 1024,), float(k))) for k in range(9)]  # 64 KiB each: over half of 1 MiB
        # The daemon answers the request in its own time, and the put after its answer reads it: wait for
        # the grant rather than a guess at how long a loaded machine takes to make it.
        d.wait_for(lambda s: s["counters"]["arenas_granted"] >= 2, what="the next arena, asked for at low water")
        held += [c.put(torch.full((16 * 1024,), float(k))) for k in range(9, 20)]  # 20 of them: 1.25 MiB
        s = d.stats()
        assert s["counters"]["reserves"] == 0 and s["counters"]["arena_publishes"] == 20
        assert s["counters"]["arenas_granted"] >= 2
        for k, desc in enumerate(held):
            assert torch.equal(c.get(desc), torch.full((16 * 1024,), float(k)))
            c.ack(desc)
        assert c.flush()
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the arenas to go back")


def test_a_burst_asks_ahead_for_every_next_arena_while_the_full_ones_are_still_read(daemon_factory) -> None:
    """A producer ahead of its consumer fills arena after arena, and the full ones stay in its set until
    their features end. Each next arena is still asked for once the current one is half full, so no put
    of the burst finds every arena full and reserves (two requests, where the arena's is one for a ring)."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "1", "--arenas-per-session", "8")
    with d.client(inline_threshold=0, fallback="error") as c:
        held = []
        for k in range(15 * 5):  # 64 KiB each, 15 to an arena: five arenas' worth, none acked
            held.append(c.put(torch.full((16 * 1024,), float(k))))
            # The put that passed half asked without waiting; the one after reads the grant. Waiting for
            # the daemon's answer here takes the machine's speed out of it: what is tested is the asking.
            assert c.session.fd.sync(10.0)
        s = d.stats()
        assert s["counters"]["reserves"] == 0, "a put of the burst found every arena full and reserved"
        assert s["counters"]["arena_publishes"] == 75 and s["counters"]["arenas_granted"] >= 5
        for k, desc in enumerate(held):
            assert torch.equal(c.get(desc), torch.full((16 * 1024,), float(k)))
            c.ack(desc)
        assert c.flush()
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the arenas to go back")


def test_a_feature_over_half_an_arena_goes_to_an_arena_of_its_size_class(daemon_factory) -> None:
    """A feature over half the usual arena costs no message either: the producer asks once for an arena
    of its size class (a power of two at least twice it), and the next ones of that class go there. One
    whose class is over an eighth of the pool reserves."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "1")
    with d.client(inline_threshold=0, fallback="error") as c:
        small = c.put(torch.ones(1024))  # 4 KiB: the usual 1 MiB arena
        bigs = [c.put(torch.full((256 * 1024,), float(k))) for k in range(2)]  # 1 MiB each: a 2 MiB arena
        s = d.stats()
        assert s["counters"]["arena_publishes"] == 3 and s["counters"]["reserves"] == 0
        assert s["counters"]["arenas_granted"] >= 2  # the usual one, one of the 2 MiB class (and its next)
        for k, big in enumerate(bigs):
            assert torch.equal(c.get(big), torch.full((256 * 1024,), float(k)))
            c.ack(big)
        c.ack(small)
        huge = c.put(torch.ones(1 << 20))  # 4 MiB: its class, 8 MiB, fits an eighth of the pool
        over = c.put(torch.ones(5 << 18))  # 5 MiB: its class, 16 MiB, does not: reserved
        s = d.stats()
        assert s["counters"]["reserves"] == 1 and s["counters"]["arena_publishes"] == 4
        assert torch.equal(c.get(over), torch.ones(5 << 18))
        c.ack(huge)
        c.ack(over)
        assert c.flush()
        assert _consistent(d.stats()["pools"][0])
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the arenas to go back")


def test_a_session_at_its_arena_limit_gives_an_old_arena_back_for_a_new_size_class(daemon_factory,
                                                                                   monkeypatch) -> None:
    """A producer that holds arenas_per_session usual arenas and then puts a feature of a new size class
    gives back its least recently used arena and takes one of that class, instead of reserving each such
    feature until an arena goes idle; the features of the arena it gave back stay readable."""
    from mmfeat.client.link import arenas

    # The idle reaper must not take the usual arena first: on a loaded machine the steps below can outlast
    # IDLE_S, and the request would then be granted with no refusal, which is what this test counts.
    monkeypatch.setattr(arenas, "IDLE_S", 3600.0)
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "1", "--arenas-per-session", "2")
    with d.client(inline_threshold=0, fallback="error") as c:
        small = [c.put(torch.full((100 * 1024,), float(k))) for k in range(2)]  # 400 KiB each, the first arena
        d.wait_for(lambda s: s["counters"]["arenas_granted"] == 2, what="the next arena, asked for at low water")
        small += [c.put(torch.full((100 * 1024,), float(k))) for k in range(2, 4)]  # the second arena
        s = d.stats()
        assert s["counters"]["arenas_granted"] == 2 and s["counters"]["reserves"] == 0
        for k in range(4):  # 1 MiB each, the 2 MiB class: each read and acked before the next, a steady state
            big = c.put(torch.full((256 * 1024,), -float(k)))
            assert torch.equal(c.get(big), torch.full((256 * 1024,), -float(k)))
            c.ack(big)
        s = d.stats()
        assert s["counters"]["arenas_refused"] >= 1  # the limit was met ...
        assert s["counters"]["reserves"] == 0 and s["counters"]["arena_publishes"] == 8  # ... and cost nothing
        for k, t in enumerate(small):
            assert torch.equal(c.get(t), torch.full((100 * 1024,), float(k)))
            c.ack(t)
        assert c.flush()
        # Three in flight: more than one 2 MiB arena holds. The next one of the class, asked for ahead of
        # need, takes the place of the usual arena left unused for a while.
        time.sleep(1.2)
        in_flight: list[tuple[int, object]] = []

        def cycle(k: int) -> None:
            in_flight.append((k, c.put(torch.full((256 * 1024,), float(k)))))
            if len(in_flight) == 3:
                j, big = in_flight.pop(0)
                assert torch.equal(c.get(big), torch.full((256 * 1024,), float(j)))
                c.ack(big)

        # Puts go on until the daemon grants the second arena of the class: the refusal of the first
        # request, and the give-back it causes, are read at a put, however late the daemon answers.
        refused = d.stats()["counters"]["arenas_refused"]
        k, deadline = 0, time.monotonic() + 20
        while (s := d.stats())["counters"]["arenas_granted"] < 4:
            assert time.monotonic() < deadline, f"no second arena of the class after {k} puts: {d.stats()}"
            cycle(k)
            k += 1
        # One request refused, then one granted: the refusal gave the idle usual arena back at once,
        # where a retry each second would be refused until the reaper took that arena (IDLE_S).
        assert s["counters"]["arenas_refused"] == refused + 1
        before = d.stats()["counters"]["reserves"]
        for k in range(k, k + 8):  # the grant is read at the next put; from there on no feature reserves
            cycle(k)
        assert d.stats()["counters"]["reserves"] == before
        for j, big in in_flight:
            c.ack(big)
        assert c.flush()
        assert _consistent(d.stats()["pools"][0])
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the arenas to go back")


def test_an_arena_for_a_feature_is_refused_when_its_class_is_too_large(daemon) -> None:
    """The daemon sizes the arena, and refuses, typed, one over an eighth of the pool (128 MiB here)."""
    with daemon.client(inline_threshold=0) as c:
        with pytest.raises(MmfeatError) as err:
            c.session.fd.call("arena", nbytes=9 << 20)
        assert err.value.code is ErrorCode.TOO_LARGE and "eighth" in err.value.message
        reply = c.session.fd.call("arena", nbytes=5 << 20)
        assert reply["arena"]["size"] == 16 << 20
        with pytest.raises(MmfeatError) as err:
            c.session.fd.call("arena", nbytes=0)
        assert err.value.code is ErrorCode.BAD_REQUEST


def test_the_message_path_without_libatomic(daemon) -> None:
    """A client without libatomic maps the table read-only and uses reserve, publish and ack messages."""
    code = """
import sys, torch
from mmfeat.client import Client
from mmfeat import atomics
assert not atomics.AVAILABLE
with Client(sys.argv[1], inline_threshold=0, fallback="error") as c:
    assert not c.session.table.writable and c.session.arenas is None
    for k in range(5):
        d = c.put(torch.full((4096,), float(k)))
        assert torch.equal(c.get(d), torch.full((4096,), float(k)))
        c.ack(d)
    assert c.flush()
"""
    env = {**os.environ, "MMFEAT_NO_ATOMICS": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(daemon.runtime_dir)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    s = daemon.stats()
    assert s["counters"]["reserves"] == 5 and s["counters"]["arena_publishes"] == 0 and s["pools"][0]["used"] == 0


@pytest.mark.skipif(not atomics.PLAIN_ORDERED, reason="loads and stores go through libatomic here anyway")
def test_libatomic_and_plain_moves_share_one_table(daemon_factory) -> None:
    """On x86-64 clients and daemons load and store table words as plain moves; aarch64 takes libatomic's
    calls. CI runs on x86-64, so this keeps the libatomic path of the whole handshake exercised: a daemon
    and a producer on libatomic, a consumer (this process) on plain moves, every byte and ack counted."""
    d = daemon_factory("--pool-mb", "64", env={"MMFEAT_ATOMICS": "libatomic"})
    code = """
import sys, torch
from mmfeat.client import Client
from mmfeat import atomics
assert atomics.AVAILABLE and not atomics.PLAIN_ORDERED
with Client(sys.argv[1], inline_threshold=0, fallback="error") as c:
    for k in range(40):
        print(c.put(torch.full((1024 + k,), float(k)), consumers=2).to_bytes().hex(), flush=True)
"""
    env = {**os.environ, "MMFEAT_ATOMICS": "libatomic"}
    out = subprocess.run([sys.executable, "-c", code, str(d.runtime_dir)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    with d.client(inline_threshold=0) as c:
        for k, line in enumerate(out.stdout.split()):
            desc = bytes.fromhex(line)
            assert torch.equal(c.get(desc), torch.full((1024 + k,), float(k)))
            c.ack(desc, count=2)
        assert c.flush()
    s = d.stats()
    assert s["counters"]["arena_publishes"] == 40 and s["counters"]["table_acks"] == 80
    assert s["counters"]["frees"] == 40 and s["pools"][0]["used"] == 0


def test_arenas_take_at_most_half_the_pool(daemon_factory) -> None:
    """However many producers hold arenas, reserves keep half the pool."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "4")
    clients = [d.client(inline_threshold=0) for _ in range(4)]
    try:
        granted = 0
        for c in clients:
            for _ in range(4):  # arenas_per_session
                try:
                    c.session.fd.call("arena")
                    granted += 1
                except MmfeatError as exc:
                    assert exc.code is ErrorCode.POOL_FULL and "half" in exc.message
        s = d.stats()
        assert granted == 8 and s["pools"][0]["arenas"]["bytes"] == 32 << 20 and s["counters"]["arenas_refused"] == 8
        big = clients[0].put(torch.ones(6 << 20))  # 24 MiB: reserved, in the half arenas cannot take
        assert not big.is_inline and d.stats()["counters"]["reserves"] == 1
        clients[0].ack(big)
    finally:
        for c in clients:
            c.close()
    # Arenas asked for by hand are not the clients' to return: their sessions' ends give them back.
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the sessions' arenas to go back")


def test_threads_sharing_a_client_place_features_without_overlap(daemon) -> None:
    """Eight threads put through one Client at once: the ring hands each its own range and slot."""
    import threading

    errors: list[str] = []
    with daemon.client(inline_threshold=0, fallback="error") as producer, daemon.client() as consumer:
        def work(k: int) -> None:
            try:
                for i in range(60):
                    x = torch.full((4096 + 97 * k,), float(k * 1000 + i))
                    desc = producer.put(x)
                    if not torch.equal(consumer.get(desc), x):
                        errors.append(f"thread {k} feature {i} reads other bytes")
                    consumer.ack(desc)
            except Exception as exc:  # reported below: a thread's exception would otherwise vanish
                errors.append(f"thread {k}: {exc!r}")

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:5]
        s = daemon.wait_for(_no_features, what="the last acks")
        assert s["counters"]["frees"] == 480 and s["counters"]["bad_table_words"] == 0
    assert daemon.pool()["used"] == 0
