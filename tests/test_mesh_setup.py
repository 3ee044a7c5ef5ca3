"""A mesh set up wrong says so: docs/operations.md's example starts as written, and a peer that refuses our key,
a peer with our own node id and a daemon whose NIXL cannot start each show as a state in stats, a
metric and one log line, not as a peer forever ``joining`` or a healthy daemon that cannot pull."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mmfeat.daemon.metrics import _mesh_metrics

from .cluster import _free_port, _gen_keys
from .conftest import Daemon, start_daemon

OPERATIONS = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()


def _samples(mesh: dict) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in _mesh_metrics(mesh) for s in f.samples}


def _stop(d: Daemon) -> str:
    """Stop ``d`` (it must exit 0 on SIGTERM) and give its log."""
    rc = d.stop()
    _, err = d.proc.communicate()
    shutil.rmtree(d.runtime_dir, ignore_errors=True)
    assert rc == 0, err[-2000:]
    return err


def test_the_operations_pages_mesh_example_starts_a_daemon_as_written(tmp_path) -> None:
    etc = tmp_path / "etc-mmfeat"  # /etc/mmfeat in docs/operations.md
    command = re.search(r"^(?:sudo )?\S*mmfeatd --gen-keys /etc/mmfeat\b", OPERATIONS, re.M)
    assert command is not None, "docs/operations.md's key command changed; update this test with it"
    r = subprocess.run([sys.executable, "-m", "mmfeat.daemon", "--gen-keys", str(etc)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    example = re.search(r"```toml\n# /etc/mmfeat/mmfeatd.toml on node A\n(.*?)```", OPERATIONS, re.S)
    assert example is not None, "docs/operations.md's mesh example changed; update this test with it"
    other_key = _gen_keys(tmp_path / "node-b")
    port, other_port = _free_port(), _free_port()
    # Only what cannot be the same here changes: the addresses, and the placeholder for B's key.
    config = (example.group(1).replace("10.0.0.1:7400", f"127.0.0.1:{port}")
              .replace("10.0.0.2:7400", f"127.0.0.1:{other_port}").replace("<node B's mesh.public>", other_key))
    (etc / "mmfeatd.toml").write_text(config)
    runtime = Path(tempfile.mkdtemp(prefix="mmf-readme-", dir="/tmp"))
    d = start_daemon(runtime, "--config", str(etc / "mmfeatd.toml"), "--pool-mb", "8")
    mesh = d.stats()["mesh"]
    assert mesh["listen"] == f"tcp://127.0.0.1:{port}"
    assert mesh["public_key"] == (etc / "mesh.public").read_text().strip()  # the key beside the config
    _stop(d)

    # Under systemd the unit's mesh drop-in hands over a copy in $CREDENTIALS_DIRECTORY, which wins over
    # the file beside the config (that one may be root's alone).
    creds = tmp_path / "credentials"
    handed = _gen_keys(creds)
    d = start_daemon(runtime, "--config", str(etc / "mmfeatd.toml"), "--pool-mb", "8",
                     env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert d.stats()["mesh"]["public_key"] == handed
    _stop(d)

    # A relative mesh_secret_file is beside the config, wherever the daemon runs from.
    (etc / "keys").mkdir()
    (etc / "mesh.secret").rename(etc / "keys" / "mesh.secret")
    (etc / "mmfeatd.toml").write_text(config + 'mesh_secret_file = "keys/mesh.secret"\n')
    d = start_daemon(runtime, "--config", str(etc / "mmfeatd.toml"), "--pool-mb", "8")
    assert d.stats()["mesh"]["public_key"] == (etc / "mesh.public").read_text().strip()
    _stop(d)


def test_a_peer_with_this_nodes_own_node_id_is_refused_loudly(cluster, tmp_path) -> None:
    cluster.node("a")
    cluster.node("b")
    a = cluster.start("a", ["b"], log=tmp_path / "a.log")
    b = cluster.start("b", ["a"], env={"MMFEAT_NODE_ID": "a"}, log=tmp_path / "b.log")  # a cloned host
    for d in (a, b):
        s = d.wait_for(lambda s: s["mesh"]["peers"][0]["state"] == "node_id_conflict", timeout=20,
                       what="the clone refused")
        peer = s["mesh"]["peers"][0]
        assert peer["node"] is None and peer["epoch"] is None  # nothing it said counts
        assert _samples(s["mesh"])[("mmfeat_mesh_peers", (("state", "node_id_conflict"),))] == 1
    time.sleep(2.5)  # more hellos: it stays refused, and the log says it once
    assert a.stats()["mesh"]["peers"][0]["state"] == "node_id_conflict"
    cluster.stop("a")
    cluster.stop("b")
    for name in ("a", "b"):
        log = (tmp_path / f"{name}.log").read_text()
        assert log.count("announces node_id 'a', which is this node's own") == 1, log[-3000:]


def test_a_peer_that_refuses_this_nodes_key_is_reported_not_joining_forever(cluster, tmp_path) -> None:
    cluster.node("a")
    cluster.node("b")
    b = cluster.start("b", [])  # lists nobody: a's key is refused at b's door
    a = cluster.start("a", ["b"], log=tmp_path / "a.log")
    # libzmq gives up on a refused key; the daemon connects again (the peer's list may get fixed), and
    # counts every refusal.
    s = a.wait_for(lambda s: s["mesh"]["peers"][0]["auth_failures"] >= 2, timeout=30, what="two refusals")
    assert s["mesh"]["peers"][0]["state"] == "auth_failed"
    samples = _samples(s["mesh"])
    assert samples[("mmfeat_mesh_peers", (("state", "auth_failed"),))] == 1
    assert samples[("mmfeat_mesh_auth_failures_total", (("peer", cluster.endpoint("b")),))] >= 2
    assert b.stats()["mesh"]["refused"] >= 2
    cluster.stop("a")
    log = (tmp_path / "a.log").read_text()
    assert log.count(f"peer {cluster.endpoint('b')} refused this node's key") == 1, log[-3000:]


def test_a_meshed_daemon_whose_nixl_cannot_start_is_unhealthy(cluster) -> None:
    pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed: make setup installs mmfeat[mesh]")
    cluster.node("a")
    cluster.node("b")
    a = cluster.start("a", ["b"])
    b = cluster.start("b", ["a"], env={"UCX_NET_DEVICES": "no-such-nic0"})
    s = b.stats()["mesh"]
    assert s["transport"] is None and s["transport_error"], s
    assert _samples(s)[("mmfeat_mesh_transport_up", ())] == 0
    health = [sys.executable, "-m", "mmfeat.cli", "--timeout", "10"]
    r = subprocess.run([*health, "--runtime-dir", str(b.runtime_dir), "health"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "cannot pull" in r.stderr and s["transport_error"] in r.stderr, (r.stdout, r.stderr)
    r = subprocess.run([*health, "--runtime-dir", str(a.runtime_dir), "health"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("mmfeatd ok"), r.stderr
    assert _samples(a.stats()["mesh"])[("mmfeat_mesh_transport_up", ())] == 1
