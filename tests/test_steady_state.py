"""The daemon's share of a steady flow of features: no message per feature, and few wake-ups.

While features flow through arenas the daemon's CPU is its wake-ups (each starts cache-cold after
payload copies of many MiB), not its work per feature; large features come a few dozen a second, so
these tests hold the two things that set its cost per feature: the messages features send it, and how
often its loop wakes for a client that writes nothing.
"""

from __future__ import annotations

import time

import torch


def test_large_features_in_steady_state_send_the_daemon_no_message_each(daemon, monkeypatch) -> None:
    """Features over half the usual arena (8 MiB in this 128 MiB pool) go to an arena of their size class,
    granted once: forty more of them are published and acked through the lease table with no request to
    the daemon (the producer's stats call is the only one it takes)."""
    from mmfeat.client.link import arenas

    # The warm-up's first put takes a usual arena too, which none of these features uses: on a loaded
    # machine the loop can outlast IDLE_S, and the reaper's return of it would be one more request.
    monkeypatch.setattr(arenas, "IDLE_S", 3600.0)
    with daemon.client(inline_threshold=0, fallback="error") as producer, daemon.client(readonly=True) as consumer:
        x = torch.full((6 << 20,), 7, dtype=torch.uint8)  # 6 MiB: a 16 MiB arena of its own class
        warm = producer.put(x)
        consumer.get(warm)
        consumer.ack(warm)
        before = producer.stats()["counters"]
        for k in range(40):
            x.fill_(k)
            desc = producer.put(x)
            assert torch.equal(consumer.get(desc)[:4096], x[:4096])
            consumer.ack(desc)
        after = producer.stats()["counters"]
    assert after["arena_publishes"] - before["arena_publishes"] == 40 and after["reserves"] == 0
    assert after["arenas_granted"] == before["arenas_granted"]
    assert after["requests"] - before["requests"] == 1, (before, after)
    s = daemon.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="every feature ended")
    assert s["counters"]["frees"] == after["arena_publishes"]


def sweeps(counters: dict) -> int:
    """Every sweep: those that found a word changed, and those that found none (the idle loop's)."""
    return counters["sweeps"] + counters["sweeps_skipped"]


def test_a_client_that_writes_nothing_wakes_the_daemon_loop_about_once_a_second(daemon) -> None:
    """With a client attached and nothing written, the loop sweeps (and does its housekeeping) once a
    second: each of its wake-ups is a cold start while a server's payload copies flow, so several a
    second were most of the daemon's CPU per large feature. A slow machine wakes it fewer times, never
    more: the bound holds whatever the load."""
    with daemon.client(inline_threshold=0) as producer, daemon.client(readonly=True) as consumer:
        desc = producer.put(torch.zeros(1 << 20, dtype=torch.uint8))
        consumer.get(desc)
        consumer.ack(desc)
        before = sweeps(producer.stats()["counters"])
        t0 = time.monotonic()
        time.sleep(4.0)
        after = sweeps(producer.stats()["counters"])
        seconds = time.monotonic() - t0
    # Each stats call sweeps once (the second counts here); the timer sweeps come once a second.
    assert after - before <= seconds + 2, f"{after - before} sweeps in {seconds:.1f} s with nothing written"


def test_a_steady_put_of_one_host_tensor_skips_the_general_path(daemon) -> None:
    """Once a session has its arena, a put of one dense host tensor is placed, copied and published by
    Producer._put_now alone: none of the general path's steps (each a frame and an object more per
    feature) runs, and the bytes are the same."""
    import sys

    with daemon.client(inline_threshold=0, fallback="error") as producer, daemon.client(readonly=True) as consumer:
        x = torch.arange(16384, dtype=torch.float32)
        consumer.ack(producer.put(x))  # the general path sets up the pool, its mapping and descriptor head
        called: set[str] = set()

        def trace(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
            if event == "call" and frame.f_code.co_filename.endswith("producer.py"):
                called.add(frame.f_code.co_name)

        descs = []
        sys.setprofile(trace)
        try:
            for k in range(20):
                descs.append(producer.put(x + k))
        finally:
            sys.setprofile(None)
        assert called == {"put_one", "_put_now"}, called
        for k, desc in enumerate(descs):
            assert torch.equal(consumer.get(desc), x + k)
            consumer.ack(desc)
