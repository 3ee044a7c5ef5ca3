"""On a GPU: a feature in one node's CUDA pool, read by a consumer of another node (two daemons on
one machine, meshed): the owner's pool is mapped in its daemon and registered with NIXL as VRAM, and
the consumer's daemon pulls it into its own pool. On one machine the pools are POSIX-fd pools, so the
route is a pull, not the FABRIC relay (which needs two nodes of one NVLink domain)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

try:
    from mmfeat.nixl import load_nixl

    load_nixl()
except RuntimeError as exc:  # NixlUnavailable
    pytest.skip(f"{exc} (tests/gpu/prepare_wheels.sh carries it)", allow_module_level=True)


def test_a_cuda_pool_feature_is_pulled_by_another_node(cluster, tmp_path) -> None:
    for n in ("a", "b"):
        cluster.node(n)
    a = cluster.start("a", ["b"], "--pool-mb", "256", backend="cuda_vmm", log=tmp_path / "a.log")
    b = cluster.start("b", ["a"], "--pool-mb", "256", backend="cuda_vmm", log=tmp_path / "b.log")
    s = b.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "up" and s["mesh"]["peers"][0]["node"], timeout=30,
                   what="a up")
    pool = s["mesh"]["peers"][0]["pools"][0]
    print(f"b's view of a's pool: {pool}; b's transport {s['mesh']['transport']!r} ({s['mesh']['transport_error']})")
    why = [line for line in (tmp_path / "a.log").read_text().splitlines() if "NIXL" in line]
    assert pool["kind"] == "cuda" and pool["fabric"] is False and pool["pullable"], (pool, why)
    torch.cuda.set_device(0)
    x = torch.randn(4, 1 << 20, device="cuda:0")
    with a.client(inline_threshold=0, fallback="error") as producer, b.client() as consumer:
        desc = producer.put(x, consumers=1)
        got = consumer.get(desc)
        assert got.is_cuda and torch.equal(got, x)
        del got
        assert consumer.ack(desc, wait=True)["freed"]
    peer = b.stats()["mesh"]["peers"][0]
    print(f"pulled {peer['bytes_pulled']} B in {peer['pulls']} pull(s)")
    assert peer["pulls"] == 1
