"""The vLLM EC connector's CPU ranks load retained items as views of the pool, against a real mmfeatd
with each half in processes of its own (tests/vllm_roles.py): the encoder-cache entry is the pool's
memory, the hold stays while any rank's entry lives (through an evict and pool pressure) and ends with
the last one, a view is copied out before its hold could expire, a view whose hold ended unseen is
dropped rather than read, and a rank that dies holding views leaves nothing once its engine ends."""

from __future__ import annotations

import os
import signal
import time

from mmfeat.client import Client, Namespace
from mmfeat.integrations.vllm import StepLoads

from .test_vllm_connector import _books_balance, _produce, _requests, _settings
from .vllm_roles import NS, Engine

ITEM = 64 * 256 * 2  # bytes of vllm_roles.encoder_output


def _acks(s: dict) -> int:
    """Acks the daemon applied, from the lease table or as messages (a daemon without arenas)."""
    return s["counters"]["acks"]


def _step_until(cons: Engine, rank: int, what: str, done, timeout: float = 60.0) -> dict:
    """Steps with nothing to load until ``done`` holds for ``rank``'s counters (a copy-out is made by a
    thread of the rank, and swapped in by the rank's next step)."""
    deadline = time.monotonic() + timeout
    while True:
        cons.run(StepLoads(), [])
        if done(cons.counters[rank]):
            return cons.counters[rank]
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {cons.counters[rank]}"
        time.sleep(0.05)


def test_a_cpu_rank_hands_vllm_a_view_of_the_pool_held_until_every_rank_frees_it(daemon_factory, children) -> None:
    daemon = daemon_factory("--pool-mb", "4", "--arena-mb", "0")
    rt, hashes = str(daemon.runtime_dir), ["img-a", "img-b"]
    _produce(children, rt, hashes)
    cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children)
    reqs = _requests("pd", hashes)
    meta, compute = cons.schedule(reqs)
    report = cons.run(meta, compute, apply=False)
    # Loaded, and each rank owes its ack: the scheduler gives nothing back, and its books are settled.
    assert report.loaded == {h: 2 for h in hashes} and report.acked == {h: 2 for h in hashes}
    cons.end_step(reqs, report, finish_first=True)
    assert cons.side.counters["holds_released"] == 0 and cons.side.unsettled_loads() == 0
    for rank in range(2):
        c = cons.counters[rank]
        assert c["in_pool"] == hashes, f"rank {rank} copied its items instead of viewing the pool: {c}"
        assert c["views_held"] == 2 and c["view_bytes_held"] == 2 * ITEM, c
    s = daemon.stats()
    assert s["holds"] == 2 and _acks(s) == 0, s["counters"]
    # Evicted, and far more saved than the pool holds: the held items stay and read right.
    with Client(rt, map_pools=False) as c:
        assert all(c.evict(Namespace(**NS).key(h)) for h in hashes)
    _produce(children, rt, [f"img-{i}" for i in range(200)])
    assert daemon.stats()["namespaces"][Namespace(**NS).id]["evictions"] > 0
    cons.run(StepLoads(), [])  # each rank checks every entry's bytes again
    # One rank frees img-a: the other still reads it, so the hold stays.
    cons.free(["img-a"], ranks=[0])
    daemon.wait_for(lambda s: _acks(s) == 1, timeout=15, what="rank 0's ack of img-a")
    assert daemon.stats()["holds"] == 2
    assert cons.counters[0]["views_held"] == 1 and cons.counters[0]["view_bytes_held"] == ITEM
    cons.free(["img-a"], ranks=[1])
    daemon.wait_for(lambda s: s["holds"] == 1, timeout=15, what="img-a's hold ended by the last rank's ack")
    cons.free(["img-b"])
    daemon.wait_for(lambda s: s["holds"] == 0, timeout=15, what="img-b's hold ended")
    assert all(cons.counters[r]["views_held"] == 0 for r in range(2))
    assert cons.close() == 4
    _books_balance(daemon, hashes + [f"img-{i}" for i in range(200)])


def test_a_view_is_copied_out_before_its_hold_could_expire_and_the_copy_takes_its_place(daemon, children) -> None:
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    cons = Engine(rt, _settings(view_ttl_s=0.2), producer=False, consumer=True, ctx=children)
    reqs = _requests("pd", ["img-a"])
    cons.step(reqs)
    cons.finish(reqs)
    c = _step_until(cons, 0, "the view copied out", lambda c: c["views_copied_out"] == 1)
    # The entry is the rank's own copy now (the rank checked its bytes), and the view's death acked.
    assert c["cached"] == ["img-a"] and c["in_pool"] == [] and c["views_held"] == 0, c
    daemon.wait_for(lambda s: s["holds"] == 0, timeout=15, what="the hold ended by the view's ack")
    cons.free(["img-a"])
    cons.close()
    _books_balance(daemon, ["img-a"])


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_view_whose_hold_ended_before_it_was_copied_out_is_dropped_never_read(daemon_factory, children) -> None:
    """A rank that does not run for longer than half the daemon's ack_ttl (stopped here right after it
    loaded) finds its hold gone when it copies the view out: nothing proves the bytes are the item's,
    so the entry goes, and vLLM fails a request that needs it instead of reading them."""
    daemon = daemon_factory("--ack-ttl", "8")
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])  # retained for far longer: only the hold ends
    cons = Engine(rt, _settings(), producer=False, consumer=True, ctx=children)
    meta, compute = cons.schedule(_requests("pd", ["img-a"]))
    cons.inboxes[0].put(("load_then_stop", meta, compute))
    pid = cons.procs[0].pid
    deadline = time.monotonic() + 60
    while not _stopped(pid):
        assert time.monotonic() < deadline, "the rank did not stop after its load"
        time.sleep(0.05)
    daemon.wait_for(lambda s: s["counters"]["holds_expired"] == 1, timeout=60, what="the hold's ack_ttl")
    os.kill(pid, signal.SIGCONT)
    _, _, report, _ = cons.outbox.get(timeout=60)
    assert report.loaded == {"img-a": 1}
    cons.side.update_connector_output(report)
    c = _step_until(cons, 0, "the lost view dropped", lambda c: c["views_lost"] == 1)
    assert c["cached"] == [] and c["views_held"] == 0 and c["views_copied_out"] == 0, c
    cons.close()
    s = _books_balance(daemon, ["img-a"])  # and no ack of the hold that had ended
    assert s["counters"]["holds_expired"] == 1


def test_a_rank_killed_holding_views_leaves_nothing_once_its_engine_ends(daemon, children) -> None:
    """vLLM ends an engine whose worker died: the scheduler's session, which holds for the ranks, ends
    with it and takes the dead rank's owed unit along. Until then the item stays, as the rank's ack
    never came."""
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children)
    reqs = _requests("pd", ["img-a"])
    cons.step(reqs)
    cons.finish(reqs)
    assert all(cons.counters[r]["in_pool"] == ["img-a"] for r in range(2))
    cons.kill(1)
    cons.free(["img-a"], ranks=[0])
    daemon.wait_for(lambda s: _acks(s) == 1, timeout=15, what="rank 0's ack")
    assert daemon.stats()["holds"] == 1, "the dead rank's view was never freed: its unit is still owed"
    cons.close()
    s = _books_balance(daemon, ["img-a"])
    assert s["counters"]["holds_reclaimed"] == 1


def test_a_views_pool_bytes_hold_and_fds_come_back_when_vllm_frees_the_entry(daemon, children) -> None:
    """The engine runs on: only the entry's end gives the item back, and once it did the pool is as
    empty as before the load, the hold is gone, and the rank has the fds and foreign tensors it had."""
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    cons = Engine(rt, _settings(), producer=False, consumer=True, ctx=children)
    reqs = _requests("pd", ["img-a"])
    cons.step(reqs)
    cons.finish(reqs)
    loaded = cons.counters[0]
    assert loaded["in_pool"] == ["img-a"] and loaded["views_held"] == 1, loaded
    with Client(rt, map_pools=False) as c:
        assert c.evict(Namespace(**NS).key("img-a"))
    s = daemon.stats()
    assert s["holds"] == 1 and s["pools"][0]["used"] >= ITEM, "the viewed item went while vLLM had it"
    cons.run(StepLoads(), [])  # the rank reads its entry again: the item's own bytes
    cons.free(["img-a"])
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and sum(s["leases"].values()) == 0 and s["holds"] == 0,
                    timeout=15, what="the item freed by the entry's end, the engine still running")
    freed = cons.counters[0]
    assert freed["cached"] == [] and freed["views_held"] == 0 and freed["view_bytes_held"] == 0, freed
    assert freed["fds"] == loaded["fds"] and freed["capsules"] == loaded["capsules"] - 1, (loaded, freed)
    assert cons.close() == 1
    assert daemon.stats()["counters"]["over_acks"] == 0


def test_a_ranks_views_keep_at_most_view_max_bytes_of_the_pool_and_loads_past_it_copy(daemon, children) -> None:
    rt, hashes = str(daemon.runtime_dir), ["img-a", "img-b", "img-c", "img-d"]
    _produce(children, rt, hashes)
    cons = Engine(rt, _settings(view_max_bytes=2 * ITEM), producer=False, consumer=True, ctx=children)
    reqs = _requests("pd", hashes[:3])
    cons.step(reqs)
    cons.finish(reqs)
    c = cons.counters[0]
    assert c["in_pool"] == ["img-a", "img-b"] and c["cached"] == hashes[:3], c  # img-c is the rank's own copy
    assert c["views_held"] == 2 and c["view_bytes_held"] == 2 * ITEM and c["views_over_bound"] == 1, c
    daemon.wait_for(lambda s: s["holds"] == 2, timeout=15, what="the copy's ack of img-c's hold")
    # An entry freed makes room: the next load is a view again.
    cons.free(["img-a"])
    reqs = _requests("pd2", ["img-d"])
    cons.step(reqs)
    cons.finish(reqs)
    c = cons.counters[0]
    assert c["in_pool"] == ["img-b", "img-d"] and c["views_over_bound"] == 1, c
    cons.free(hashes)
    daemon.wait_for(lambda s: s["holds"] == 0, timeout=15, what="every hold ended by its entry's end")
    assert cons.close() == 4
    _books_balance(daemon, hashes)


def test_an_item_under_view_min_bytes_is_copied_and_its_hold_ends_with_the_load(daemon, children) -> None:
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    cons = Engine(rt, _settings(view_min_bytes=ITEM + 1), producer=False, consumer=True, ctx=children)
    reqs = _requests("pd", ["img-a"])
    cons.step(reqs)
    cons.finish(reqs)
    c = cons.counters[0]
    assert c["cached"] == ["img-a"] and c["in_pool"] == [] and c["views"] == 0 and c["views_held"] == 0, c
    daemon.wait_for(lambda s: s["holds"] == 0, timeout=15, what="the copy's ack")
    assert cons.close() == 1
    _books_balance(daemon, ["img-a"])


def test_a_forked_child_that_drops_the_views_it_inherited_does_not_end_the_ranks_hold(daemon, children) -> None:
    """A child forked from a rank (a compile or data worker) has the rank's encoder cache, views
    included: its copies are not vLLM's entries, and dropping them must not ack the hold the rank's
    views still need, or the rank would read bytes the pool may give to another item."""
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    cons = Engine(rt, _settings(), producer=False, consumer=True, ctx=children)
    reqs = _requests("pd", ["img-a"])
    cons.step(reqs)
    cons.finish(reqs)
    assert cons.counters[0]["in_pool"] == ["img-a"] and cons.counters[0]["views_held"] == 1
    cons.inboxes[0].put(("fork",))
    assert cons.outbox.get(timeout=60) == ("forked", 0, 0)
    with Client(rt, map_pools=False) as c:
        c.flush()
    s = daemon.stats()
    assert s["holds"] == 1 and _acks(s) == 0, ("the child acked the rank's hold", s["counters"])
    cons.run(StepLoads(), [])  # the rank's view still reads its item
    cons.free(["img-a"])
    daemon.wait_for(lambda s: s["holds"] == 0, timeout=15, what="the hold ended by the rank's own ack")
    assert cons.close() == 1
    _books_balance(daemon, ["img-a"])


def test_a_view_whose_hold_ended_is_dropped_at_the_next_step_even_before_the_copy_out_thread_runs(
        daemon_factory, children) -> None:
    """A rank that did not run for longer than the ack_ttl wakes with two threads ready: the runner may
    step before the copy-out thread finds the hold gone. The step itself checks: an entry whose hold
    ended is dropped before the model reads it, whatever the pool did with its bytes meanwhile."""
    daemon = daemon_factory("--pool-mb", "4", "--arena-mb", "0", "--ack-ttl", "8")
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    cons = Engine(rt, _settings(), producer=False, consumer=True, ctx=children)
    reqs = _requests("pd", ["img-a"])
    cons.step(reqs)
    cons.finish(reqs)
    assert cons.counters[0]["in_pool"] == ["img-a"]
    cons.inboxes[0].put(("lock_copy_out",))
    assert cons.outbox.get(timeout=60) == ("locked", 0)
    daemon.wait_for(lambda s: s["counters"]["holds_expired"] == 1, timeout=60, what="the hold's ack_ttl")
    # The item goes and its bytes are given to others.
    with Client(rt, map_pools=False) as c:
        assert c.evict(Namespace(**NS).key("img-a"))
    _produce(children, rt, [f"img-{i}" for i in range(200)])
    assert daemon.stats()["namespaces"][Namespace(**NS).id]["evictions"] > 0
    cons.inboxes[0].put(("locked_step", StepLoads()))
    _, _, wrong, c = cons.outbox.get(timeout=60)
    assert wrong == [], f"the rank's step read other bytes than its items': {wrong}"
    assert c["cached"] == [] and c["views_lost"] == 1 and c["views_held"] == 0, c
    cons.close()
    s = _books_balance(daemon, ["img-a"] + [f"img-{i}" for i in range(200)])
    assert s["counters"]["holds_expired"] == 1
