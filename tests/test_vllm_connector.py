"""The vLLM EC connector's two halves against a real mmfeatd, each half in processes of its own and
driven in vLLM's call order (tests/vllm_roles.py), without vLLM: several consumer instances on one key,
a loading rank that dies holding a hold, the producer gone after it saved, eviction under pressure,
an abort before load, an ec_both instance reusing what it saved, and the daemon's books at the end."""

from __future__ import annotations


import pytest

from mmfeat.client import Client, Namespace
from mmfeat.integrations.vllm import ConnectorSettings

from .ttls import put_and_hold, sleep_until
from .vllm_roles import NS, Engine, Feature, Request, encoder_output

RETAIN_S = 120.0  # longer than any test: the ends are made by evictions, holds ending and sessions dying


def _requests(prefix: str, hashes: list[str]) -> list[Request]:
    return [Request(f"{prefix}-{i}", [Feature(h)]) for i, h in enumerate(hashes)]


def _settings(**kw) -> ConnectorSettings:
    # Every retained item a CPU rank loads is a view of the pool, as a large one is: these are small.
    return ConnectorSettings(**{"retain_ttl_s": RETAIN_S, "view_min_bytes": 0, **kw})


def _produce(ctx, rt: str, hashes: list[str], **kw) -> list:
    """An encode-only instance saves every item, then exits; what its request_finished returned."""
    prod = Engine(rt, _settings(**kw), producer=True, consumer=False, ctx=ctx)
    reqs = _requests("e", hashes)
    prod.step(reqs)
    params = prod.finish(reqs)
    prod.close()
    return params


def _books_balance(daemon, hashes: list[str]) -> dict:
    """Nothing held and nothing else live: once the items are evicted, the pool is empty and no hold,
    lease or key is left, and no ack went beyond what a lease or hold expected."""
    with Client(str(daemon.runtime_dir), map_pools=False) as c:
        for h in hashes:
            c.evict(Namespace(**NS).key(h))
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and sum(s["leases"].values()) == 0
                        and s["holds"] == 0, timeout=15, what="the books to balance")
    assert s["counters"]["over_acks"] == 0, s["counters"]
    return s


def test_several_consumer_instances_load_one_saved_item_after_its_producer_exited(daemon, children) -> None:
    rt = str(daemon.runtime_dir)
    hashes = ["img-a", "img-b", "img-c"]
    params = _produce(children, rt, hashes)
    assert all(p and "mmfeat" in p[h] for p, h in zip(params, hashes)), params
    saved = daemon.stats()["counters"]  # each save into the arena, its key bound by a message nobody waited for
    assert saved["reserves"] == 0 and saved["binds"] == len(hashes) and saved["reclaimed_on_disconnect"] == 0
    for instance in range(2):
        cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children)
        reqs = _requests(f"pd{instance}", hashes)
        meta, compute = cons.schedule(reqs)
        assert compute == [] and sorted(meta.loads) == hashes  # every item from the pool, none encoded
        report = cons.run(meta, compute)
        assert report.loaded == {h: 2 for h in hashes} and not report.failed
        assert cons.finish(reqs) == [None] * 3
        assert cons.close() == 2 * len(hashes)  # each rank checked each item's bytes
        assert cons.side.counters["hits"] == 3 and cons.side.counters["holds"] == 3
    s = daemon.stats()
    assert s["namespaces"][Namespace(**NS).id]["hits"] >= 6
    _books_balance(daemon, hashes)


@pytest.mark.parametrize("finish_first", [True, False], ids=["finish_before_report", "report_before_finish"])
def test_a_rank_that_dies_holding_a_hold_leaves_nothing_behind(daemon, children, finish_first: bool) -> None:
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children)
    reqs = _requests("pd", ["img-a"])
    meta, compute = cons.schedule(reqs)
    report = cons.run(meta, compute, kill_rank=1, apply=False)  # rank 1 dies before it loads or acks
    assert report.loaded == {"img-a": 1}
    # The dead rank's unit of the hold, and only that one, is given back once the request ended and its
    # step's report is in, whichever vLLM applies first; then the TTL frees the item.
    cons.end_step(reqs, report, finish_first)
    assert cons.side.counters["holds_released"] == 1
    cons.close()
    _books_balance(daemon, ["img-a"])


def test_a_hold_keeps_an_item_past_its_ttl_and_the_holders_death_ends_it(daemon) -> None:
    rt = str(daemon.runtime_dir)
    holder = Client(rt, map_pools=False)
    holder.connect()  # before the TTL's clock starts: the hold is one request after the put
    with Client(rt, inline_threshold=0) as producer:
        held = put_and_hold(lambda k, ttl: producer.put(encoder_output("img-a"), key=k, retain_ttl=ttl),
                            lambda k: holder.hold(k, count=1), lambda n: Namespace(**NS).key(f"img-a{n}"), 1.0)
    sleep_until(held.ran_out_by + 1.5)  # past the TTL, and past the sweeps that would end it
    with Client(rt, map_pools=False) as other:
        assert other.has(held.key), "a held item went at its TTL"
    holder.close()  # the holder's session ends: its hold with it, and the TTL has passed
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["holds"] == 0, timeout=15,
                    what="the item freed once its holder's session ended")


def test_an_abort_between_a_steps_metadata_and_its_load_leaves_the_hold_to_the_ranks(daemon, children) -> None:
    """vLLM finishes an aborted request between steps, and under async scheduling a step that loads
    one of its items may be on the ranks by then: they load it whatever happened to the request, so
    the hold is theirs to end, and the scheduler gives back only what their report says they did not ack."""
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children)
    reqs = _requests("pd", ["img-a"])
    meta, compute = cons.schedule(reqs)
    assert daemon.stats()["holds"] == 1
    cons.finish(reqs)  # aborted, with the step that loads its item already sent
    assert daemon.stats()["holds"] == 1, "the hold ended under ranks that are still to read it"
    report = cons.run(meta, compute)
    assert report.loaded == {"img-a": 2} and not report.failed
    assert cons.side.counters["holds_released"] == 0
    cons.free(["img-a"])  # the ranks' views of it go: their acks end the hold
    daemon.wait_for(lambda s: s["holds"] == 0, timeout=15, what="the hold ended by the ranks' acks")
    assert cons.close() == 2
    _books_balance(daemon, ["img-a"])


def test_a_step_no_rank_ran_is_given_back_whole_once_a_later_step_reports(daemon, children) -> None:
    """vLLM applies its steps' outputs in the order it sent the steps, so when a later step reports, an
    earlier one that has not never will: what it loaded for a finished request is given back whole,
    and the books hold nothing for it."""
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a", "img-b"])
    cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children)
    lost, later = _requests("lost", ["img-a"]), _requests("later", ["img-b"])
    cons.schedule(lost)  # its metadata never reaches the ranks
    cons.finish(lost)
    assert daemon.stats()["holds"] == 1 and cons.side.counters["holds_released"] == 0
    meta, compute = cons.schedule(later)
    assert cons.run(meta, compute).loaded == {"img-b": 2}
    cons.finish(later)
    assert cons.side.counters["holds_released"] == 1 and cons.side.unsettled_loads() == 0
    cons.free(["img-b"])  # the ranks' views of it go
    daemon.wait_for(lambda s: s["holds"] == 0, timeout=15, what="both holds ended")
    cons.close()
    _books_balance(daemon, ["img-a", "img-b"])


def test_an_item_evicted_after_the_lookup_still_loads_because_the_hold_came_with_it(daemon, children) -> None:
    """The lookup and the hold are one request: an item found is already held when has_cache_item says
    so, and vLLM is committed from then on. An eviction (by key, or the pool's need for space) before
    the ranks copy it unbinds the key and leaves the bytes to the hold."""
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children)
    req = _requests("pd", ["img-a"])[0]
    assert cons.side.ensure_cache_available(req, 0) and cons.side.has_cache_item("img-a")
    with Client(rt, map_pools=False) as evictor:
        assert evictor.evict(Namespace(**NS).key("img-a"))
        assert not evictor.has(Namespace(**NS).key("img-a"))
    cons.side.update_state_after_alloc(req, 0)
    meta = cons.side.build_connector_meta(None)
    assert list(meta.loads) == ["img-a"] and cons.side.take_unavailable_requests() == set()
    report = cons.run(meta, [])
    assert report.loaded == {"img-a": 2} and not report.failed
    cons.finish([req])
    assert cons.close() == 2  # each rank read the item's own bytes
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["holds"] == 0, timeout=15,
                    what="the evicted item freed once its hold ended")


def test_eviction_under_pressure_takes_unheld_items_and_never_a_held_one(daemon_factory, children) -> None:
    daemon = daemon_factory("--pool-mb", "4", "--arena-mb", "0")
    rt = str(daemon.runtime_dir)
    first = ["img-0"]
    _produce(children, rt, first)
    key0 = Namespace(**NS).key("img-0")
    holder = Client(rt, map_pools=False)
    assert holder.hold(key0, count=1) is not None
    # Far more than the pool holds: the oldest unheld items go, the held one stays and reads right.
    _produce(children, rt, [f"img-{i}" for i in range(1, 200)])
    with Client(rt) as reader:
        assert reader.has(key0)
        assert reader.has(Namespace(**NS).key("img-199"))
        assert torch_equal(reader.get(key=key0, copy=True), encoder_output("img-0"))
        s = reader.stats()
    assert s["namespaces"][Namespace(**NS).id]["evictions"] > 0
    holder.close()
    _books_balance(daemon, [f"img-{i}" for i in range(200)])


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_an_ec_both_instance_reuses_what_it_saved(daemon, children) -> None:
    rt = str(daemon.runtime_dir)
    both = Engine(rt, _settings(), producer=True, consumer=True, ctx=children)
    first = _requests("r1", ["img-a"])
    meta, compute = both.schedule(first)
    assert compute == ["img-a"] and not meta.loads  # nothing saved yet: encoded here, then saved
    both.run(meta, compute)
    both.finish(first)
    meta, compute = both.schedule(_requests("r2", ["img-a"]))
    assert compute == [] and list(meta.loads) == ["img-a"]
    both.run(meta, compute)
    both.close()
    _books_balance(daemon, ["img-a"])


def test_counted_lifetime_frees_each_item_after_its_consumers(daemon, children) -> None:
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"], lifetime="counted", consumers=2)
    cons = Engine(rt, _settings(lifetime="counted", consumers=2), producer=False, consumer=True, ranks=2, ctx=children)
    reqs = _requests("pd", ["img-a"])
    cons.step(reqs)
    cons.finish(reqs)
    cons.close()
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, timeout=10, what="counted item freed")


@pytest.mark.parametrize("finish_first", [True, False], ids=["finish_before_report", "report_before_finish"])
def test_each_instance_takes_its_own_count_of_a_counted_item_whatever_vllm_applies_first(
        daemon, children, finish_first: bool) -> None:
    """Two prefill-only instances (every request finishes in the step that loads it) of two ranks each
    load the same counted items, made for their four loads: each instance takes exactly its ranks'
    acks, so the first leaves the items to the second, and the second's loads free them."""
    rt, hashes, ranks, instances = str(daemon.runtime_dir), ["img-a", "img-b"], 2, 2
    keys = [Namespace(**NS).key(h) for h in hashes]
    settings = dict(lifetime="counted", consumers=ranks * instances)
    _produce(children, rt, hashes, **settings)
    for instance in range(instances):
        cons = Engine(rt, _settings(**settings), producer=False, consumer=True, ranks=ranks, ctx=children)
        reqs = _requests(f"pd{instance}", hashes)
        meta, compute = cons.schedule(reqs)
        assert compute == [] and sorted(meta.loads) == hashes, f"instance {instance} found the items gone"
        report = cons.run(meta, compute, apply=False)
        assert report.loaded == {h: ranks for h in hashes} and not report.failed
        cons.end_step(reqs, report, finish_first)
        if instance == 0:
            # Every ack so far is in the daemon's books (the ranks and the scheduler flushed theirs).
            with Client(rt, map_pools=False) as c:
                assert c.has_many(keys) == [True, True], "the first instance took the second's count"
        assert cons.side.counters["holds_released"] == 0
        assert cons.close() == ranks * len(hashes)  # each rank checked each item's bytes
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and sum(s["leases"].values()) == 0
                        and s["holds"] == 0, timeout=15, what="the counted items freed by their last loads")
    assert s["counters"]["over_acks"] == 0 and s["counters"]["expired"] == 0, s["counters"]


@pytest.mark.parametrize("bad", [{"lifetime": "forever"}, {"retain_ttl_s": -1}, {"consumers": 0},
                                 {"retain_ttl_s": "soon"}, {"namespce": "x"}, {"view_max_bytes": -1},
                                 {"view_max_bytes": 1.5}, {"view_min_bytes": "1K"},
                                 {"view_ttl_s": 0}])
def test_a_wrong_extra_config_stops_the_engine_at_start_naming_the_field(bad) -> None:
    with pytest.raises(ValueError, match="mmfeat connector"):
        ConnectorSettings.from_extra_config(bad)
