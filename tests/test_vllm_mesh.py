"""The vLLM connector across nodes: a producer instance saves on node A, consumer instances on node B
load through the mesh, each node a network namespace of its own with UCX on TCP over the veth between
them (skipped with the reason where namespaces cannot be made). The connector's halves run in separate
processes in vLLM's call order (tests/vllm_roles.py); every rank checks every byte it loaded.

A request that names A's item is scheduled on B only once the item is in B's pool and held there for
its ranks; one whose pull never lands fails at load_wait_s; and B pulls each item once, whatever the
number of its loading ranks and instances."""

from __future__ import annotations

import signal
import time

import pytest

from mmfeat.integrations.vllm import ConnectorSettings

from .cluster import meshed
from .vllm_roles import Engine
from .xnode_bytes import RETAIN_S, load_all, measure, produce, requests

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed: make setup installs mmfeat[mesh]")
pytestmark = pytest.mark.parametrize("cluster", ["netns"], indirect=True)

ITEM = "@4096"  # 2 MiB an item


def test_a_request_is_scheduled_only_once_another_nodes_item_landed_here(cluster, children) -> None:
    a, b = meshed(cluster)
    settings = ConnectorSettings(retain_ttl_s=RETAIN_S)
    hashes = [f"far-{i}{ITEM}" for i in range(2)]
    params = produce(children, str(a.runtime_dir), hashes, settings)
    consumer = Engine(str(b.runtime_dir), settings, producer=False, consumer=True, ranks=2, ctx=children)
    try:
        reqs = requests(hashes, params, "c")
        # The owner answers nothing while it is stopped: no pull can land, however many steps pass.
        a.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(3):
                meta, compute = consumer.schedule(reqs)
                assert not meta.loads and not compute, f"scheduled before its item was here: {b.stats()['mesh']}"
                assert not consumer.side.take_unavailable_requests()
            assert b.stats()["mesh"]["copies"] == 0
        finally:
            a.proc.send_signal(signal.SIGCONT)

        def landed(engine: Engine, meta) -> None:
            mesh = b.stats()["mesh"]
            assert mesh["copies"] >= len(meta.loads) and mesh["pulls_in_flight"] == 0, mesh

        load_all([consumer], [reqs], on_loads=landed)
        # The ranks view the pulled copies (2 MiB items): each rank's ack comes when vLLM drops its entry.
        consumer.free(hashes)
        s = b.wait_for(lambda s: s["holds"] == 0, timeout=30, what="the ranks' acks to end every hold")
        assert consumer.side.unsettled_loads() == 0 and s["counters"]["over_acks"] == 0
        assert s["mesh"]["peers"][0]["pulls"] == 2 and s["mesh"]["peers"][0]["pull_failures"] == 0
    finally:
        assert consumer.close() == 2 * len(hashes)  # each rank checked each item's bytes


def test_a_pull_that_never_lands_fails_its_request_at_load_wait_s(cluster, children) -> None:
    a, b = meshed(cluster)
    wait_s = 20.0
    settings = ConnectorSettings(retain_ttl_s=RETAIN_S, load_wait_s=wait_s)
    hashes = [f"lost{ITEM}"]
    params = produce(children, str(a.runtime_dir), hashes, settings)
    consumer = Engine(str(b.runtime_dir), settings, producer=False, consumer=True, ranks=2, ctx=children)
    req, = requests(hashes, params, "c")
    a.proc.send_signal(signal.SIGSTOP)  # a peer that never answers: up, then silent, then down
    try:
        started = time.monotonic()
        failed: set[str] = set()
        while not failed:
            assert time.monotonic() - started < wait_s + 120, "the request never failed"
            step = time.monotonic()
            meta, compute = consumer.schedule([req])
            # A step waits for pulls a bounded time, not the request's whole load_wait_s.
            assert time.monotonic() - step < wait_s / 2
            assert not meta.loads and not compute, (time.monotonic() - started, b.stats()["mesh"])
            failed = consumer.side.take_unavailable_requests()
        assert failed == {req.request_id} and time.monotonic() - started >= wait_s
    finally:
        a.proc.send_signal(signal.SIGCONT)
    consumer.finish([req])  # vLLM ends the request it failed
    s = b.wait_for(lambda s: s["holds"] == 0, timeout=30, what="no hold left for the failed request")
    assert consumer.side.unsettled_loads() == 0 and s["mesh"]["copies"] == 0
    consumer.close()


def test_a_node_pulls_each_item_once_whatever_its_loading_ranks_and_instances(cluster, children) -> None:
    a, b = meshed(cluster)
    items, tokens, ranks, instances = 3, 2048, 4, 2
    row = measure(children, str(a.runtime_dir), str(b.runtime_dir), lambda: cluster.netns.veth_bytes(1)[0],
                  "once", items, tokens, ranks, instances)
    total = items * row["item_bytes"]
    # One copy of each item crossed, not one per instance (2x) or per loading rank (8x).
    assert total <= row["veth_rx"] < 1.5 * total, row
    peer = b.stats()["mesh"]["peers"][0]
    assert peer["pulls"] == items and peer["pull_failures"] == 0 and peer["bytes_pulled"] == total, peer
