"""Features that cross nodes: real daemons on 127.0.0.1 as separate nodes, meshed over CURVE, pulling
with NIXL (UCX) and relaying acks; producers and consumers in their own processes. What fails and
what attacks it: test_remote_failures.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mmfeat.client.link.channel import ControlChannel
from mmfeat.daemon.metrics import _mesh_metrics
from mmfeat.daemon.mesh.remote import copy_pool, fabric_reply, route
from mmfeat.protos.errors import ErrorCode, MmfeatError
from mmfeat.protos.mesh import (FABRIC_HANDLE_BYTES, MeshError, MeshFabricDomain, MeshPool, decode_mesh,
                                 encode_mesh)
from mmfeat.protos.messages import LeaseRef
from mmfeat.protos.paths import control_endpoint

from . import workers
from .conftest import fd_count
from .cluster import idle, meshed

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed: make setup installs mmfeat[mesh]")


def test_a_producer_on_a_feeds_consumers_on_a_and_b_every_byte(cluster, children) -> None:
    a, b = meshed(cluster, pool_mb=256)
    fds_b = fd_count(b.pid)
    ctx = children
    q_prod, q_a, q_b, results = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    consumers = [ctx.Process(target=workers.consume, args=(str(d.runtime_dir), q, results, copy))
                 for d, q, copy in ((a, q_a, False), (b, q_b, False))]
    producer = ctx.Process(target=workers.produce, args=(str(a.runtime_dir), 2, q_prod))
    for p in (*consumers, producer):
        p.start()
    n = 0
    while (item := q_prod.get(timeout=120)) is not None:
        q_a.put(item)
        q_b.put(item)
        n += 1
    q_a.put(None)
    q_b.put(None)
    out = [results.get(timeout=180) for _ in consumers]
    for p in (*consumers, producer):
        p.join(30)
    assert out == [("ok", n), ("ok", n)], out  # every byte compared, put_many and features up to 24 MiB included
    idle(a, "a to free every feature once both nodes acked")
    s = idle(b, "b to drop every pulled copy")
    peer = s["mesh"]["peers"][0]
    assert peer["pulls"] == n and peer["pull_failures"] == 0 and peer["acks_relayed"] == n
    assert peer["bytes_pulled"] >= 24 << 20
    served = a.stats()["mesh"]["peers"][0]
    assert served["checks_served"] == n and served["acks_received"] == n and served["ended_sent"] == n
    assert s["mesh"]["copies"] == 0 and a.stats()["counters"]["over_acks"] == 0
    assert fd_count(b.pid) <= fds_b + 2  # UCX may keep a connection to the peer open


@pytest.mark.parametrize("cluster", ["host", "netns"], indirect=True)
def test_concurrent_gets_on_one_node_pull_once_and_waiting_acks_come_from_the_owner(cluster) -> None:
    """As host: two daemons on 127.0.0.1 (UCX reads through cross-memory attach); as netns: each in a
    network namespace of its own, the 64 MiB pulled over TCP across a veth."""
    a, b = meshed(cluster)
    with a.client(inline_threshold=0, fallback="error") as producer, b.client() as c1, b.client() as c2:
        x = torch.randn(4, 4 << 20)  # 64 MiB: long enough a pull for the second get to find it under way
        desc = producer.put(x, consumers=3)
        got: dict[str, torch.Tensor] = {}
        threads = [threading.Thread(target=lambda c=c, k=k: got.__setitem__(k, c.get(desc)))
                   for k, c in (("1", c1), ("2", c2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert torch.equal(got["1"], x) and torch.equal(got["2"], x)
        assert torch.equal(c1.get(desc.to_bytes(), copy=True), x)  # a later get: the same copy
        mesh = b.stats()["mesh"]
        peer = mesh["peers"][0]
        assert peer["pulls"] == 1 and peer["shared_gets"] == 2 and peer["bytes_pulled"] == 64 << 20
        assert mesh["copies"] == 1 and mesh["copy_bytes"] == 64 << 20
        families = {f.name: f for f in _mesh_metrics(mesh)}
        assert ([(s.labels, s.value) for s in families["mmfeat_mesh_pulled_bytes"].samples]
                == [({"peer": "a"}, 64 << 20)])
        exported = {n + ("_total" if f.type == "counter" else "") for n, f in families.items()}
        operations = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
        for metric in re.findall(r"`(mmfeat_mesh_[a-z_]+)", operations):
            assert metric in exported, f"docs/operations.md names {metric}, which a meshed daemon does not export"
        table = subprocess.run([sys.executable, "-m", "mmfeat.cli", "--runtime-dir", str(b.runtime_dir), "stats"],
                               capture_output=True, text=True, timeout=300).stdout
        assert "pulls with nixl" in table and "pulled MiB" in table and " 64 " in table, table
        assert c1.ack(desc, wait=True) == {"remaining": 2, "freed": False, "over_acked": 0}
        got.clear()  # the views go before the acks that end them
        # A consumer that never read (a cache hit) acks too; over-acks are clamped and counted at the owner.
        assert c2.ack(desc, count=4, wait=True) == {"remaining": 0, "freed": True, "over_acked": 2}
        with pytest.raises(MmfeatError) as gone:
            c2.ack(desc, wait=True)
        assert gone.value.code in (ErrorCode.NOT_FOUND, ErrorCode.STALE)
    assert a.stats()["counters"]["over_acks"] == 2
    idle(a, "a to free the feature")
    idle(b, "b to drop its copy once a said the feature ended")
    cluster.check_data_plane("b", 64 << 20)


def test_a_prefetch_pulls_ahead_and_the_get_finds_the_copy(cluster) -> None:
    a, b = meshed(cluster)
    with a.client(inline_threshold=0, fallback="error") as producer, b.client() as consumer:
        batch = [producer.put(torch.full((1 << 18,), float(k)), consumers=1) for k in range(3)]
        consumer.prefetch(batch)  # as a scheduler does with a batch it received
        with a.client(inline_threshold=1 << 30) as inliner:
            consumer.prefetch(inliner.put(torch.ones(8)))  # inline: nothing to do
        b.wait_for(lambda s: s["mesh"]["copies"] == 3, timeout=30, what="the three prefetched copies")
        for k, desc in enumerate(batch):
            assert torch.equal(consumer.get(desc), torch.full((1 << 18,), float(k)))
            consumer.ack(desc)
        peer = b.stats()["mesh"]["peers"][0]
        assert peer["pulls"] == 3 and peer["shared_gets"] == 3  # each get found its copy
        with a.client() as local:
            desc = producer.put(torch.ones(1 << 16), consumers=1)
            local.prefetch(desc)  # a's own feature: no pull
            local.ack(desc)
    idle(a, "a to free every feature")
    idle(b, "b to drop every copy")
    assert b.stats()["mesh"]["peers"][0]["pulls"] == 3


def test_three_nodes_pull_one_feature_and_it_ends_everywhere_after_the_last_ack(cluster) -> None:
    """One feature of a's with a consumer on each of b and c: both pull it, a frees it only after both
    acks, and then tells both to drop their copies (it keeps who pulled what per feature, per peer)."""
    a, b, c = meshed(cluster, nodes=("a", "b", "c"))
    x = torch.randn(1 << 18)
    with a.client(inline_threshold=0, fallback="error") as producer, b.client() as on_b, c.client() as on_c:
        desc = producer.put(x, consumers=2)
        assert torch.equal(on_b.get(desc), x) and torch.equal(on_c.get(desc), x)
        assert on_b.ack(desc, wait=True) == {"remaining": 1, "freed": False, "over_acked": 0}
        assert a.pool()["leases"]["PUBLISHED"] == 1 and c.stats()["mesh"]["copies"] == 1  # c still reads
        assert torch.equal(on_c.get(desc), x)  # from the copy c pulled, not a second pull
        assert on_c.ack(desc, wait=True) == {"remaining": 0, "freed": True, "over_acked": 0}
    idle(a, "a to free the feature")
    for node, d in (("b", b), ("c", c)):
        s = idle(d, f"{node} to drop its copy once a said the feature ended")
        peer = next(p for p in s["mesh"]["peers"] if p["node"] == "a")
        assert (peer["pulls"], peer["shared_gets"], peer["acks_relayed"]) == (1, 1 if node == "c" else 0, 1), \
            (node, peer)
    served = {p["node"]: p for p in a.stats()["mesh"]["peers"]}
    assert served["b"]["ended_sent"] == served["c"]["ended_sent"] == 1
    assert served["b"]["acks_received"] == served["c"]["acks_received"] == 1
    # remote_get's into_pool (a pool per GPU: the reading rank's) is checked, and a pool that cannot
    # take pulls (this host daemon has only pool 0) falls back to one that can.
    with a.client(inline_threshold=0, fallback="error") as producer, b.client() as on_b:
        desc = producer.put(torch.arange(1000), consumers=1)
        channel = ControlChannel(control_endpoint(b.runtime_dir), 10.0)
        try:
            with pytest.raises(MmfeatError) as bad:
                channel.call("remote_get", node="a", lease=desc.lease_ref(), wait_s=5, into_pool=-1)
            assert bad.value.code is ErrorCode.BAD_REQUEST
            reply = channel.call("remote_get", node="a", lease=desc.lease_ref(), wait_s=5, into_pool=7)
            assert reply["lease"]["pool"] == 0 and reply["lease"]["nbytes"] == desc.nbytes
        finally:
            channel.close()
        assert torch.equal(on_b.get(desc), torch.arange(1000))  # the copy that request made
        on_b.ack(desc)
    assert next(p for p in b.stats()["mesh"]["peers"] if p["node"] == "a")["pulls"] == 2
    idle(a, "a to free the second feature")


def test_a_node_without_nixl_says_what_to_install(cluster, tmp_path) -> None:
    hidden = tmp_path / "hide"
    for name in ("nixl", "nixl_cu12", "nixl_cu13"):
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    cluster.node("a")
    cluster.node("b")
    a = cluster.start("a", ["b"])
    b = cluster.start("b", ["a"], env={"PYTHONPATH": str(hidden)})
    s = b.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "up" and s["mesh"]["peers"][0]["node"], timeout=20,
                   what="a up")
    assert s["mesh"]["transport"] is None and "mmfeat[mesh]" in s["mesh"]["transport_error"]
    with a.client(inline_threshold=0, fallback="error") as producer, b.client() as consumer:
        desc = producer.put(torch.ones(1000), consumers=1)
        with pytest.raises(MmfeatError) as refused:
            consumer.get(desc)
        assert refused.value.code is ErrorCode.NO_TRANSPORT and "mmfeat[mesh]" in refused.value.message
        assert consumer.ack(desc, wait=True)["freed"]  # acks still cross: the consumer can say it gave up
    # The feature can still travel inline, as the error says.
    with a.client(inline_threshold=1 << 30) as producer, b.client() as consumer:
        desc = producer.put(torch.ones(1000))
        assert desc.is_inline and torch.equal(consumer.get(desc), torch.ones(1000))


def test_data_devices_this_node_lacks_leave_pulls_off_with_the_reason(cluster) -> None:
    cluster.node("a")
    cluster.node("b")
    cluster.start("a", ["b"])
    b = cluster.start("b", ["a"], "--data-devices", "nosuchdev9")
    s = b.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "up", timeout=20, what="a up")["mesh"]
    assert s["transport"] is None
    assert "UCX_NET_DEVICES=nosuchdev9" in s["transport_error"] and "data_devices" in s["transport_error"]


def test_a_descriptor_whose_feature_ended_is_stale_on_another_node_never_new_bytes(cluster) -> None:
    a, b = meshed(cluster)
    with a.client(inline_threshold=0, fallback="error") as producer, a.client() as local, b.client() as remote:
        old = producer.put(torch.full((1 << 16,), 7.0), consumers=1)
        assert local.ack(old, wait=True)["freed"]
        # New features take the space (and, in the producer's arena ring, the slots) the old one had.
        new = [producer.put(torch.full((1 << 16,), float(k)), consumers=1) for k in range(8)]
        assert any((d.offset, d.pool) == (old.offset, old.pool) for d in new)
        with pytest.raises(MmfeatError) as stale:
            remote.get(old)  # the bytes pulled are a new feature's: the owner's table says so
        assert stale.value.code in (ErrorCode.STALE, ErrorCode.NOT_FOUND)
        for d in new:
            local.ack(d)
    idle(b, "b to release the range of the refused pull")


def _cpu_seconds(pid: int) -> float:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def _cuda_runtimes_mapped(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "libcudart.so" in line}


def test_an_idle_meshed_daemon_with_nixl_costs_next_to_no_cpu_and_has_its_cuda_runtime(cluster) -> None:
    # NIXL's own agent class spins its UCX progress thread: a whole core per daemon, forever.
    a, b = meshed(cluster)
    assert a.stats()["mesh"]["transport"] == "nixl"
    # mmfeatd imports no torch, and a node or image without a CUDA toolkit has no libcudart on its
    # library paths: NIXL's UCX then cannot register a GPU pool (docs/gpu.md). The mesh extra
    # installs the runtime's wheel, and the daemon loads it before NIXL starts.
    loaded = _cuda_runtimes_mapped(a.pid)
    # The wheel's file is libcudart.so.12 itself; a toolkit's resolves to libcudart.so.12.<minor>.<patch>.
    assert any("/libcudart.so.12" in path for path in loaded), f"no CUDA 12 runtime in the daemon: {loaded}"
    with a.client(inline_threshold=0, fallback="error") as producer, b.client() as consumer:
        desc = producer.put(torch.ones(1 << 16), consumers=1)
        consumer.get(desc)  # UCX has connected both ways
        consumer.ack(desc)
    idle(b, "the copy to go")
    before = {d.pid: _cpu_seconds(d.pid) for d in (a, b)}
    time.sleep(2)
    used = {pid: _cpu_seconds(pid) - cpu0 for pid, cpu0 in before.items()}
    assert all(u < 0.2 for u in used.values()), f"CPU seconds in 2 idle seconds: {used}"


def test_the_route_to_a_feature_is_fabric_only_in_a_shared_nvlink_domain() -> None:
    fabric = MeshPool(pool=0, kind="cuda", device=0, handle="fabric", size=1 << 30, fabric=b"\1" * FABRIC_HANDLE_BYTES)
    here = MeshFabricDomain(cluster_uuid="ab" * 16, clique=7)
    assert route(fabric, here, MeshFabricDomain(cluster_uuid="ab" * 16, clique=7)) == "fabric"
    # NCCL's MNNVL rule: another clique, or another cluster, cannot import the handle.
    assert route(fabric, here, MeshFabricDomain(cluster_uuid="ab" * 16, clique=8)) == "pull"
    assert route(fabric, here, MeshFabricDomain(cluster_uuid="cd" * 16, clique=7)) == "pull"
    assert route(fabric, here, None) == "pull"  # the owner announced no domain (NVML could not say)
    assert route(fabric, None, here) == "pull"  # no MNNVL domain here: the bytes are pulled
    assert route(fabric, here, here, pull=True) == "pull"  # the client's import failed
    posix = MeshPool(pool=0, kind="cuda", device=0, handle="posix_fd", size=1 << 30)
    assert route(posix, here, here) == "pull"
    assert route(MeshPool(pool=0, kind="host", device=-1, handle="posix_fd", size=1 << 20), here, here) == "pull"
    hello = {"node": "a", "epoch": 1, "pools": [], "fabric_domain": {"cluster_uuid": "ab" * 16, "clique": 7}}
    assert decode_mesh(encode_mesh("hello", hello))[1].fabric_domain == here
    for bad in ({"cluster_uuid": "AB" * 16, "clique": 7}, {"cluster_uuid": "ab" * 15, "clique": 7},
                {"cluster_uuid": "ab" * 16, "clique": -1}, {"cluster_uuid": "ab" * 16, "clique": 1 << 32}):
        with pytest.raises(MeshError):
            decode_mesh(encode_mesh("hello", {**hello, "fabric_domain": bad}))
    # What the client then maps: the fields client/gpu/cuda_import.py reads for a FABRIC pool of its own daemon.
    ref = LeaseRef(pool=0, epoch=9, lease=3, gen=4, token=b"t" * 16, offset=256, nbytes=1024)
    reply = fabric_reply("a", 9, fabric, ref).to_wire()
    info = reply["fabric"]
    assert info["handle"] == "fabric" and info["fabric"] == b"\1" * FABRIC_HANDLE_BYTES
    assert (info["pool"], info["epoch"], info["size"], info["node"]) == (0, 9, 1 << 30, "a")
    assert reply["lease"] == ref.model_dump()


def test_a_pulled_copy_goes_to_the_pool_the_client_names_when_that_pool_can_take_it() -> None:
    """remote_get's into_pool: on a node with a pool per GPU, the copy lands on the reading rank's GPU. The
    choice here; the protocol (validation, the fallback on a host daemon) in the three-node test above; the
    GPU run exercises the pools themselves."""
    assert copy_pool({0: "gpu0", 1: "gpu1", 3: "gpu3"}, 3) == 3
    assert copy_pool({0: "gpu0", 1: "gpu1"}, 2) == 0  # not registered with NIXL: the first that is
    assert copy_pool({1: "gpu1"}, None) == 1


def test_the_remote_bench_runs(tmp_path) -> None:
    """A few-second `mmfeat bench --remote`, so that it cannot rot: two meshed daemons of its own, the
    default rounds (3: one round on a shared machine is off by 2-3x); test_bench covers the verdicts."""
    out = tmp_path / "remote.json"
    r = subprocess.run([sys.executable, "-m", "mmfeat.cli", "bench", "--remote", "--sizes", "64K", "--count", "6",
                        "--modes", "remote_premade,nixl_read", "--json", str(out)], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"remote_premade", "nixl_read"}
    assert all(row["features_per_s"] > 0 and row["size"] == 64 << 10 for row in rows.values())
    premade = rows["remote_premade"]
    assert premade["get_p50_us"] > 0 and premade["x_nixl_read"] > 0
    assert rows["nixl_read"]["x_nixl_read"] == 1.0 and all(row["count"] == 6 for row in rows.values())
    assert all(row["rounds"] == 3 for row in rows.values()) and "medians of 3 interleaved rounds" in r.stdout
    assert "x nixl_read" in r.stdout


def test_the_remote_bench_between_network_namespaces_moves_its_bytes_over_the_veth(tmp_path) -> None:
    """`mmfeat bench --remote --netns`: each node a network namespace, UCX on TCP. What the consumer's
    node received over the veth during each row is at least what the row moved: on one host without
    this, UCX reads through cross-memory attach and the bench never saw a TCP data plane."""
    out = tmp_path / "remote.json"
    r = subprocess.run([sys.executable, "-m", "mmfeat.cli", "bench", "--remote", "--netns", "--sizes", "1M",
                        "--count", "8", "--rounds", "1", "--modes", "remote_premade,nixl_read,zmq_tcp",
                        "--json", str(out)], capture_output=True, text=True, timeout=100)
    if r.returncode != 0 and "cannot make two network namespaces" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"remote_premade", "nixl_read", "zmq_tcp"}
    for mode, row in rows.items():
        assert row["veth_bytes"] >= row["count"] * (1 << 20), (mode, row)
    assert "veth, UCX on TCP" in r.stdout and "veth MiB" in r.stdout
    assert "TOO FEW ROUNDS" not in r.stdout  # verdicts are for 16 MiB only
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith("mmfb-")], "the bench left a namespace behind"


def test_nixl_agents_get_mmfeats_ucx_defaults_unless_the_environment_sets_its_own() -> None:
    """1 MiB TCP segments (faster READs over TCP: docs/performance.md), set before UCX reads its
    environment. An operator who sets either keeps both as UCX has them: a receive segment smaller than
    the send segment (64k against our 1m) stops UCX from starting at all."""
    code = ("import os; from mmfeat.nixl import load_nixl, make_agent; make_agent(load_nixl(), 'probe'); "
            "print(os.environ.get('UCX_TCP_TX_SEG_SIZE', '-'), os.environ.get('UCX_TCP_RX_SEG_SIZE', '-'))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TCP_")}
    for given, expected in (({}, ["1m", "1m"]), ({"UCX_TCP_RX_SEG_SIZE": "64k"}, ["-", "64k"])):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=clean | given)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split() == expected, (given, r.stdout)

