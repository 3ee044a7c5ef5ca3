"""10,000 features of random sizes from three producers to three consumers, every byte checked."""

from __future__ import annotations


from . import mixed_workers as w

FEATURES = 10_000
PRODUCERS = CONSUMERS = 3


def test_ten_thousand_mixed_features_every_byte_and_exact_stats(daemon_factory, children) -> None:
    d = daemon_factory("--pool-mb", "512")
    ctx = children
    consumer_qs = [ctx.Queue() for _ in range(CONSUMERS)]
    done_qs = [ctx.Queue() for _ in range(PRODUCERS)]
    results = ctx.Queue()
    per = [FEATURES // PRODUCERS + (1 if r < FEATURES % PRODUCERS else 0) for r in range(PRODUCERS)]
    procs = [ctx.Process(target=w.consume, args=(str(d.runtime_dir), r, PRODUCERS, consumer_qs[r], done_qs, results))
             for r in range(CONSUMERS)]
    procs += [ctx.Process(target=w.produce, args=(str(d.runtime_dir), r, per[r], consumer_qs, done_qs[r], results))
              for r in range(PRODUCERS)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    produced = {rank: s for kind, rank, s in got if kind == "producer"}
    consumed = {rank: s for kind, rank, s in got if kind == "consumer"}
    assert sum(s["pool"] + s["inline"] for s in produced.values()) == FEATURES
    assert all(not s["bad"] for s in consumed.values()), [s["bad"][:3] for s in consumed.values()]
    deliveries = sum(s["checked"] for s in consumed.values())
    in_pool = sum(s["pool"] for s in produced.values())
    assert in_pool > 0.9 * FEATURES, produced  # the pool, not the inline fallback, carried them
    s = d.wait_for(lambda s: s["clients"] == 0, what="every client to close")
    pool, counters = s["pools"][0], s["counters"]
    assert pool["used"] == 0 and pool["largest_free"] == pool["capacity"]
    assert s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}
    assert counters["arena_publishes"] + counters["reserves"] == in_pool == counters["frees"]
    assert counters["expired"] == 0 and counters["over_acks"] == 0 and counters["bad_table_words"] == 0
    inline_deliveries = deliveries - counters["acks"]
    assert 0 <= inline_deliveries <= 2 * (FEATURES - in_pool)
    assert counters["arenas_freed"] == counters["arenas_granted"]
