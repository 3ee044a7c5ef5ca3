"""What the vLLM connector's scheduler halves ask mmfeatd, counted in round trips by the daemon itself
(stats: requests_by_op), in vLLM's call order (tests/vllm_roles.py), with the ranks in processes of
their own: a consumer asks once per new request and never for a running one, its holds come with its
lookups and those of items vLLM did not allocate go back, a producer asks nothing per item unless its
daemon is meshed, and the scheduler's session is open before its first step."""

from __future__ import annotations

from types import SimpleNamespace

from mmfeat.client import Client, Namespace
from mmfeat.integrations.vllm import ConnectorSettings
from mmfeat.integrations.vllm.scheduler_side import SchedulerSide

from .vllm_roles import NS, Engine, Feature, Request

ASKS = ("lookup_key", "lookup", "hold", "hold_keys")  # every request a scheduler half could look an item up with


def _settings() -> ConnectorSettings:
    return ConnectorSettings(retain_ttl_s=120.0)


def _by_op(daemon) -> dict[str, int]:
    return daemon.stats()["counters"]["requests_by_op"]


def _asks(daemon) -> int:
    by_op = _by_op(daemon)
    return sum(by_op.get(op, 0) for op in ASKS)


def _ran(*requests: Request) -> SimpleNamespace:
    """What the connector reads of vLLM's SchedulerOutput: the requests that ran this step."""
    return SimpleNamespace(num_scheduled_tokens={r.request_id: 1 for r in requests}, preempted_req_ids=set())


def _produce(ctx, rt: str, hashes: list[str]) -> None:
    prod = Engine(rt, _settings(), producer=True, consumer=False, ctx=ctx)
    reqs = [Request(f"e-{h}", [Feature(h)]) for h in hashes]
    prod.step(reqs)
    prod.finish(reqs)
    prod.close()


def _balanced(daemon, hashes: list[str]) -> None:
    with Client(str(daemon.runtime_dir), map_pools=False) as c:
        for h in hashes:
            c.evict(Namespace(**NS).key(h))
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and sum(s["leases"].values()) == 0
                        and s["holds"] == 0, timeout=15, what="the books to balance")
    assert s["counters"]["over_acks"] == 0 and s["counters"]["holds_expired"] == 0, s["counters"]


def test_a_consumer_asks_once_per_new_request_and_never_while_it_runs(daemon, children) -> None:
    rt, requests, items, steps = str(daemon.runtime_dir), 3, 2, 4
    hashes = [f"img-{r}-{i}" for r in range(requests) for i in range(items)]
    _produce(children, rt, hashes)
    cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children)
    reqs = [Request(f"pd-{r}", [Feature(f"img-{r}-{i}") for i in range(items)]) for r in range(requests)]
    reqs.append(Request("pd-new", [Feature("img-never-saved")]))
    before = _asks(daemon)
    meta, compute = cons.schedule(reqs)
    assert _asks(daemon) - before == len(reqs), "not one lookup-and-hold per new request"
    assert sorted(meta.loads) == sorted(hashes) and compute == ["img-never-saved"]
    report = cons.run(meta, compute)
    assert report.loaded == {h: 2 for h in hashes} and not report.failed
    before = _asks(daemon)
    for _ in range(steps - 1):
        assert cons.decode(reqs).loads == {}
    assert _asks(daemon) == before, "a running request's later steps asked the daemon again"
    cons.finish(reqs)
    assert cons.side.unsettled_loads() == 0
    assert cons.close() == 2 * len(hashes)  # each rank read each item's own bytes
    _balanced(daemon, hashes)


def test_holds_come_with_the_lookup_and_those_vllm_did_not_allocate_go_back(daemon, children) -> None:
    """vLLM allocates only what its own encoder cache lacks, for requests it runs this step: the holds
    of the rest go back at the step's end (acks in the lease table, no round trip), and a request that
    did not run is asked again when it comes up."""
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a", "img-b", "img-c"])
    cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children)
    side = cons.side
    running = Request("pd-0", [Feature("img-a"), Feature("img-b")])  # vLLM's encoder cache has img-b
    waiting = Request("pd-1", [Feature("img-c")])  # no room for it this step
    assert side.ensure_cache_available(running, 0) and side.ensure_cache_available(waiting, 0)
    assert daemon.stats()["holds"] == 3, "the lookups took no holds"
    assert side.has_cache_item("img-a")
    side.update_state_after_alloc(running, 0)
    acks = _by_op(daemon).get("ack", 0)
    first = side.build_connector_meta(_ran(running))
    assert list(first.loads) == ["img-a"]
    s = daemon.stats()
    assert s["holds"] == 1 and s["counters"]["requests_by_op"].get("ack", 0) == acks
    before = _asks(daemon)
    assert side.ensure_cache_available(running, 0) and side.ensure_cache_available(waiting, 0)
    assert _asks(daemon) - before == 1  # the request that did not run, not the one that did
    assert side.has_cache_item("img-c")
    side.update_state_after_alloc(waiting, 0)
    second = side.build_connector_meta(_ran(running, waiting))
    assert list(second.loads) == ["img-c"]
    assert cons.run(first, []).loaded == {"img-a": 2}
    assert cons.run(second, []).loaded == {"img-c": 2}
    cons.finish([running, waiting])
    assert side.unsettled_loads() == 0 and side.counters["holds_unused"] == 2
    assert cons.close() == 4
    _balanced(daemon, ["img-a", "img-b", "img-c"])


def _encode_only(prod: Engine, hashes: list[str], prefix: str) -> list:
    """vLLM's encode-only order: each request ends in the step that encoded it, before vLLM applies that
    step's report; the params request_finished returned."""
    reqs = [Request(f"{prefix}-{h}", [Feature(h)]) for h in hashes]
    meta, compute = prod.schedule(reqs)
    report = prod.run(meta, compute, apply=False)
    params = prod.finish(reqs)
    prod.side.update_connector_output(report)
    return params


def test_a_producer_asks_nothing_per_item_on_a_daemon_without_a_mesh(daemon, children) -> None:
    """A consumer on this node looks the key up itself, and no other node can reach this one: the
    descriptor goes into the params only where the scheduler already has it (else that the item was
    saved here), and nothing that comes after a request ended is kept."""
    rt = str(daemon.runtime_dir)
    prod = Engine(rt, _settings(), producer=True, consumer=False, ctx=children)
    before = _asks(daemon)
    node = daemon.stats()["node"]
    # No descriptor yet (its report comes after the request ended): only that it was saved on this node,
    # so that a consumer here waits for the key feed to bring it rather than ask the daemon.
    assert _encode_only(prod, ["img-a", "img-b"], "early") == [{h: {"mmfeat": {"node": node}}}
                                                              for h in ("img-a", "img-b")]
    assert _asks(daemon) == before, "request_finished asked the daemon"
    assert prod.side.kept_descriptors() == 0, "descriptors reported after their requests ended are kept"
    # A request still running when its step's report comes back: the report names the descriptor.
    late = [Request("late", [Feature("img-c")])]
    prod.step(late)
    (params,) = prod.finish(late)
    assert "desc" in params["img-c"]["mmfeat"] and _asks(daemon) == before
    assert prod.side.kept_descriptors() == 0
    prod.close()
    _balanced(daemon, ["img-a", "img-b", "img-c"])


def test_a_meshed_producer_looks_each_saved_item_up_for_consumers_on_other_nodes(cluster, children) -> None:
    cluster.node("a")
    daemon = cluster.start("a", [])
    prod = Engine(str(daemon.runtime_dir), _settings(), producer=True, consumer=False, ctx=children)
    before = _asks(daemon)
    params = _encode_only(prod, ["img-a", "img-b"], "early")
    assert [p and "desc" in p[h]["mmfeat"] for p, h in zip(params, ["img-a", "img-b"])] == [True, True]
    assert _asks(daemon) - before == 2  # one lookup per item, until the mesh can look keys up
    assert prod.side.kept_descriptors() == 0
    prod.close()
    _balanced(daemon, ["img-a", "img-b"])


def test_the_scheduler_opens_its_session_at_start_not_in_its_first_step(daemon, children) -> None:
    rt = str(daemon.runtime_dir)
    _produce(children, rt, ["img-a"])
    hellos = _by_op(daemon).get("hello", 0)
    client = Client(rt, map_pools=False)
    side = SchedulerSide(client, Namespace(**NS), _settings(), False, True, 1)
    assert _by_op(daemon).get("hello", 0) == hellos + 1, "the scheduler's session did not open at start"
    req = Request("pd", [Feature("img-a")])
    assert side.ensure_cache_available(req, 0) and side.has_cache_item("img-a")
    side.update_state_after_alloc(req, 0)
    meta = side.build_connector_meta(_ran(req))
    by_op = _by_op(daemon)
    assert list(meta.loads) == ["img-a"] and by_op.get("hello", 0) == hellos + 1
    side.request_finished(req)
    client.close()  # no rank ran the step: the hold ends with the scheduler's session
    _balanced(daemon, ["img-a"])


def test_a_consumer_on_the_key_feed_asks_nothing_and_its_pins_balance(daemon, children) -> None:
    """A consumer that follows the key feed finds the items its producer saved, and pins them for its
    ranks in the lease table: no round trip, not even for a new request. The pins of items vLLM did not
    allocate go back at the step's end; the ranks' acks release the rest; an item never saved is asked
    for (one round trip) and encoded."""
    rt = str(daemon.runtime_dir)
    cons = Engine(rt, _settings(), producer=False, consumer=True, ranks=2, ctx=children, feed=True)
    cons.client.connect()  # following the feed before anything is saved (the connector connects at start)
    prod = Engine(rt, _settings(), producer=True, consumer=False, ctx=children)
    hashes = ["img-a", "img-b", "img-c"]
    params = _encode_only(prod, hashes, "e")
    prod.close()
    side = cons.side
    running = Request("pd-0", [Feature("img-a"), Feature("img-b")], {**params[0], **params[1]})
    later = Request("pd-1", [Feature("img-c"), Feature("img-never-saved")], params[2])
    before, pins = _asks(daemon), daemon.stats()["counters"]["table_pins"]
    assert side.ensure_cache_available(running, 0)
    assert _asks(daemon) == before, "a consumer on the key feed asked the daemon for saved items"
    assert side.has_cache_item("img-a")  # vLLM's encoder cache has img-b: it asks for img-a alone
    side.update_state_after_alloc(running, 0)
    first = side.build_connector_meta(_ran(running))
    assert list(first.loads) == ["img-a"] and side.counters["holds_unused"] == 1
    assert daemon.stats()["counters"]["table_pins"] - pins == 4  # two items, two ranks each
    assert side.ensure_cache_available(later, 0)
    assert _asks(daemon) == before + 1  # the item never saved, once
    assert side.has_cache_item("img-c") and not side.has_cache_item("img-never-saved")
    side.update_state_after_alloc(later, 0)
    side.update_state_after_alloc(later, 1)
    second = side.build_connector_meta(_ran(later))
    assert list(second.loads) == ["img-c"]
    assert cons.run(first, []).loaded == {"img-a": 2}
    assert cons.run(second, ["img-never-saved"]).loaded == {"img-c": 2}
    cons.finish([running, later])
    assert side.unsettled_loads() == 0
    assert cons.close() == 4
    s = daemon.stats()
    assert s["counters"]["holds"] == 0 and s["counters"]["pins_forgiven"] == 0
    _balanced(daemon, hashes)
