"""Membership that changes while daemons run: peers from a directory of peer files joining and leaving
without a restart, a key taken away ending its connections, and a peer's liveness with hysteresis
(missing after unanswered probes, back as itself, forgotten after forget_after_s). Real daemons on
127.0.0.1; what each one says comes from its stats, the CLI and its metrics. The same across network
namespaces, with DNS and pulls: test_mesh_cluster.py."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from mmfeat.daemon.metrics import _mesh_metrics
from mmfeat.protos.errors import ErrorCode, MmfeatError

from .conftest import Daemon


def _peer(s: dict, node: str) -> dict:
    """The row of ``node`` (by the name it said, else the name its source lists it by)."""
    return next(p for p in s["mesh"]["peers"] if node in (p["node"], p["listed_as"]))


def _up(*nodes: str):
    return lambda s: all(any(p["state"] == "up" and p["node"] == n for p in s["mesh"]["peers"]) for n in nodes)


def _health(d: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmfeat.cli", "--timeout", "10", "--runtime-dir", str(d.runtime_dir),
                           "health", *args], capture_output=True, text=True, timeout=60)


def _samples(s: dict) -> dict:
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in _mesh_metrics(s["mesh"]) for x in f.samples}


def test_peers_from_a_directory_join_without_a_restart_and_a_removed_one_is_cut_off(cluster) -> None:
    for n in "abc":
        cluster.node(n)
    cluster.list_peer("a", "b")
    source = {"peers_from": "dir", "peers_dir": cluster.peer_dir("a"), "peers_refresh_s": 0.1}
    b = cluster.start("b", ["a"])  # first: its DEALER connects the moment a listens
    a = cluster.start("a", [], mesh=source)
    s = a.wait_for(_up("b"), timeout=20, what="b up at a")
    # a knew b's key before it listened: b was never refused, and never waits out a retry.
    assert b.wait_for(_up("a"), timeout=20, what="a up at b")["mesh"]["peers"][0]["auth_failures"] == 0
    row = _peer(s, "b")
    assert (row["source"], row["listed_as"], row["endpoint"]) == ("dir", "b", cluster.endpoint("b"))
    assert s["mesh"]["source"]["from"] == "dir" and s["mesh"]["source"]["error"] is None
    assert s["mesh"]["quorum"] == {"members": 2, "reachable": 2, "ok": True}

    c = cluster.start("c", ["a"])  # not listed at a yet: its key is refused there
    c.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "auth_failed", timeout=30, what="c refused by a")
    cluster.list_peer("a", "c")  # c joins: a file more, no restart
    s = a.wait_for(_up("b", "c"), timeout=30, what="b and c up at a")
    c.wait_for(_up("a"), timeout=30, what="a up at c")
    assert s["mesh"]["quorum"] == {"members": 3, "reachable": 3, "ok": True}
    table = subprocess.run([sys.executable, "-m", "mmfeat.cli", "--runtime-dir", str(a.runtime_dir), "stats"],
                           capture_output=True, text=True, timeout=60).stdout
    assert f"peers from dir ({cluster.peer_dir('a')})" in table and "reaches 3 of 3 members" in table, table

    refused = s["mesh"]["refused"]
    (cluster.peer_dir("a") / "b.toml").unlink()  # b is taken away: its connections end at once
    s = a.wait_for(lambda s: _peer(s, "b")["state"] == "gone" and s["mesh"]["connections_ended"] >= 1, timeout=20,
                   what="b removed at a and its connection ended")
    assert _peer(s, "b")["node"] is None and _peer(s, "c")["state"] == "up"
    assert s["mesh"]["quorum"] == {"members": 2, "reachable": 2, "ok": True}  # b is no member any more
    # b's DEALER reconnects at once and its key is refused at the handshake; so does whatever it sends.
    a.wait_for(lambda s: s["mesh"]["refused"] > refused, timeout=20, what="b's reconnection refused")
    b.wait_for(lambda s: s["mesh"]["peers"][0]["state"] in ("missing", "auth_failed"), timeout=30,
               what="a cut off at b")
    samples = _samples(a.stats())
    assert samples[("mmfeat_mesh_peer_state", (("peer", "b"), ("source", "dir"), ("state", "gone")))] == 1
    assert samples[("mmfeat_mesh_peers", (("state", "up"),))] == 1 and samples[("mmfeat_mesh_quorum", ())] == 1
    assert samples[("mmfeat_mesh_connections_ended_total", ())] >= 1
    r = _health(a)
    assert r.returncode == 0 and "reaches 2 of 2 mesh members: a quorum" in r.stdout, (r.stdout, r.stderr)
    # A second removed key at the same name (b's key replaced, then removed again): one series per label
    # set all the same, which Prometheus insists on.
    s = a.stats()
    s["mesh"]["peers"].append({**_peer(s, "b"), "public_key": "another"})
    for family in _mesh_metrics(s["mesh"]):
        series = [(x.name, tuple(sorted(x.labels.items()))) for x in family.samples]
        assert len(series) == len(set(series)), family.name
    assert _samples(s)[("mmfeat_mesh_peer_state", (("peer", "b"), ("source", "dir"), ("state", "gone")))] == 2


def test_a_stopped_peer_goes_missing_comes_back_as_itself_and_is_forgotten_after_forget_after_s(cluster) -> None:
    """Probes every 0.2 s, missing after 5 unanswered, forgotten after 3 s missing: each step is waited
    for in stats, and a peer frozen meanwhile counts no misses of its own."""
    liveness = {"probe_interval_s": 0.2, "miss_limit": 5, "forget_after_s": 3.0}
    for n in "ab":
        cluster.node(n)
    a = cluster.start("a", ["b"], mesh=liveness)
    b = cluster.start("b", ["a"], mesh=liveness)
    epoch = a.wait_for(_up("b"), timeout=20, what="b up")["mesh"]["peers"][0]["epoch"]
    with b.client(inline_threshold=0, fallback="error") as producer:
        desc = producer.put(torch.arange(1024), consumers=1)
    b.proc.send_signal(signal.SIGSTOP)
    try:
        s = a.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "missing", timeout=20, what="b missing")
        row = s["mesh"]["peers"][0]
        assert row["misses"] >= 5 and row["epoch"] == epoch  # who it was is kept while it is missing
        assert s["mesh"]["quorum"] == {"members": 2, "reachable": 1, "ok": False}
        with a.client() as consumer, pytest.raises(MmfeatError) as info:
            consumer.get(desc)
        assert info.value.code is ErrorCode.PEER_UNAVAILABLE  # nothing goes to a missing peer
        r = _health(a)
        assert r.returncode == 0 and "no quorum" in r.stdout, (r.stdout, r.stderr)
        r = _health(a, "--require-quorum")
        assert r.returncode == 1 and "reaches 1 of 2 mesh members: no quorum" in r.stderr, (r.stdout, r.stderr)
    finally:
        b.proc.send_signal(signal.SIGCONT)
    s = a.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "up", timeout=20, what="b back")
    assert s["mesh"]["peers"][0]["epoch"] == epoch
    b.proc.send_signal(signal.SIGSTOP)
    try:
        s = a.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "gone", timeout=30, what="b forgotten")
        assert s["mesh"]["peers"][0]["epoch"] is None and s["mesh"]["peers"][0]["pools"] == []
    finally:
        b.proc.send_signal(signal.SIGCONT)
    # Still listed, so still probed: it rejoins and says who it is again.
    a.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "up" and s["mesh"]["peers"][0]["epoch"] == epoch,
               timeout=20, what="b up again with its hello")
