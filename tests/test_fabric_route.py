"""The FABRIC route between two real meshed daemons whose GPU pools are FABRIC pools of the fake driver
(tests/fake_cuda), with each node's NVLink domain set through the test-only stand-in for NVML's answer
(cuda_driver.TEST_ONLY_FABRIC_ENV). The consumer runs in its own process on the fake driver.

Neither daemon's NIXL can register a fake GPU pool, so a pull ends in NO_TRANSPORT here: that error
(rather than the import's) is how these tests see that a get took the pull path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmfeat import cuda_driver as drv
from mmfeat.protos.descriptor import Descriptor, TensorSpec

from . import fake_cuda
from .cluster import Cluster

HERE = "ab" * 16
ELSEWHERE = "cd" * 16


def _nodes(cluster: Cluster, fake_libcuda: Path, tmp_path: Path, domains: dict[str, str]) -> dict:
    imex = tmp_path / "imex-channels"
    imex.mkdir()
    (imex / "channel0").touch()
    daemons = {}
    for name, domain in domains.items():
        cluster.node(name)
    for name, domain in domains.items():
        env = {"LD_LIBRARY_PATH": str(fake_libcuda), "STUB_LOG": str(tmp_path / f"{name}.stub"),
               drv.TEST_ONLY_FABRIC_ENV: domain, drv.TEST_ONLY_IMEX_ENV: str(imex)}
        daemons[name] = cluster.start(name, [m for m in domains if m != name], "--devices", "0", "--nnodes", "2",
                                      backend="cuda_vmm", env=env, log=tmp_path / f"{name}.err")
    for d in daemons.values():
        d.wait_for(lambda s: all(p["state"] == "up" and p["node"] for p in s["mesh"]["peers"]), timeout=30,
                   what="every peer up")
    return daemons


def _feature(owner) -> Descriptor:
    """A published lease in the owner's FABRIC pool, made with raw requests: the bytes are never written
    (torch's CPU build cannot write a GPU pool, and nothing here reads them)."""
    with owner.client() as c:
        session = c._connect()
        r = c.request("reserve", session=session.token, nbytes=4096, consumers=1, device=0)
        c.request("publish", session=session.token, lease=r["lease"])
        ref = r["lease"]
        spec = TensorSpec("uint8", (4096,), (1,), 0)
        return Descriptor(kind="cuda", tensors=(spec,), nbytes=4096, node=session.node, endpoint=session.endpoint,
                          device=0, **{k: ref[k] for k in ("pool", "epoch", "lease", "gen", "token", "offset")})


def _get_on(consumer, desc: Descriptor, fake_libcuda: Path, tmp_path: Path, **env: str) -> str:
    log = fake_cuda.run(fake_libcuda, tmp_path / "consumer.log", "fabric_get",
                        {"MMFEAT_RUNTIME_DIR": str(consumer.runtime_dir),
                         "FAKE_CUDA_SCENARIO_DESC": desc.to_bytes().hex(), **env})
    return log


@pytest.mark.parametrize("owner_domain", [f"{HERE}:2", f"{ELSEWHERE}:1"], ids=["other clique", "other cluster"])
def test_no_fabric_route_between_nvlink_domains_that_differ(fake_libcuda, tmp_path, owner_domain) -> None:
    cluster = Cluster(tmp_path)
    a, b = _nodes(cluster, fake_libcuda, tmp_path, {"a": owner_domain, "b": f"{HERE}:1"}).values()
    try:
        peer = b.stats()["mesh"]["peers"][0]
        uuid, clique = owner_domain.split(":")
        assert peer["fabric_domain"] == {"cluster_uuid": uuid, "clique": int(clique)}
        log = _get_on(b, _feature(a), fake_libcuda, tmp_path)
        assert not re.search(r"^cuMemImportFromShareableHandle\(type=8\)", log, re.M), "the handle was relayed"
        assert re.search(r"=== get raised NO_TRANSPORT: .*cannot pull", log), log
        assert a.stats()["mesh"]["peers"][0]["checks_served"] == 0  # the FABRIC route starts with a check
        assert b.stats()["mesh"]["peers"][0]["fabric_fallbacks"] == 0
    finally:
        cluster.stop("a")
        cluster.stop("b")


def test_a_consumer_whose_fabric_import_fails_falls_back_to_a_pull(fake_libcuda, tmp_path) -> None:
    cluster = Cluster(tmp_path)
    a, b = _nodes(cluster, fake_libcuda, tmp_path, {"a": f"{HERE}:1", "b": f"{HERE}:1"}).values()
    try:
        # As in a container without the IMEX channel: the driver refuses the FABRIC import.
        log = _get_on(b, _feature(a), fake_libcuda, tmp_path, STUB_IMPORT_FAIL_TYPE="8")
        assert len(re.findall(r"^cuMemImportFromShareableHandle\(type=8\)", log, re.M)) == 1, log
        # The pull path's error, not the import's.
        assert re.search(r"=== get raised NO_TRANSPORT: .*cannot pull", log), log
        assert a.stats()["mesh"]["peers"][0]["checks_served"] == 1  # the relay was taken first
        assert b.stats()["mesh"]["peers"][0]["fabric_fallbacks"] == 1
    finally:
        cluster.stop("a")
        cluster.stop("b")


def test_in_one_nvlink_domain_the_consumer_maps_the_owners_handle(fake_libcuda, tmp_path) -> None:
    cluster = Cluster(tmp_path)
    a, b = _nodes(cluster, fake_libcuda, tmp_path, {"a": f"{HERE}:1", "b": f"{HERE}:1"}).values()
    try:
        log = _get_on(b, _feature(a), fake_libcuda, tmp_path)
        assert len(re.findall(r"^cuMemImportFromShareableHandle\(type=8\)", log, re.M)) == 1, log
        assert "  fabric[0]=a0 [63]=df\n" in log, log  # the owner's handle bytes, as the fake exported them
        assert "=== got the feature" in log, log
        assert b.stats()["mesh"]["peers"][0]["fabric_fallbacks"] == 0
    finally:
        cluster.stop("a")
        cluster.stop("b")


def test_a_consumer_imports_another_nodes_fabric_pool_once_and_unmaps_it_at_close(fake_libcuda, tmp_path) -> None:
    """Gets of another node's features, each view dropped before the next, import the owner's pool once:
    the consumer's session holds the mapping between gets. Closing the client unmaps it."""
    cluster = Cluster(tmp_path)
    a, b = _nodes(cluster, fake_libcuda, tmp_path, {"a": f"{HERE}:1", "b": f"{HERE}:1"}).values()
    try:
        log = fake_cuda.run(fake_libcuda, tmp_path / "consumer.log", "fabric_gets",
                            {"MMFEAT_RUNTIME_DIR": str(b.runtime_dir),
                             "FAKE_CUDA_SCENARIO_DESC": _feature(a).to_bytes().hex()})
        assert [f"=== get {i}: (4096,)" in log for i in range(3)] == [True] * 3, log
        assert len(re.findall(r"^cuMemImportFromShareableHandle\(type=8\)", log, re.M)) == 1, log
        gets = fake_cuda.section(log, "get 0: (4096,)", "close the client")
        assert "cuMemUnmap(" not in gets, f"unmapped between two gets:\n{gets}"
        closing = fake_cuda.section(log, "close the client", "client closed")
        assert closing.count("cuMemUnmap(") == 1 and closing.count("cuMemAddressFree(") == 1, log
    finally:
        cluster.stop("a")
        cluster.stop("b")
