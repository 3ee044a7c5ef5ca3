"""A few-second run of `mmfeat bench` with tiny sizes, so the benchmark cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_smoke(tmp_path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "mmfeat.client", "bench", "--sizes", "64K", "--consumers", "2", "--count", "12",
         "--control-clients", "1", "--control-seconds", "0.3", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    records = json.loads(out.read_text())
    modes = {rec["mode"] for rec in records}
    assert modes == {"memcpy", "floor", "pool_view", "pool_copy", "inline", "zmq_bytes", "torch_mp", "client_default",
                     "control_mmfeat", "control_echo"}
    for rec in records:
        assert set(rec) >= {"mode", "size", "consumers", "features_per_s", "gb_per_s", "p50_us", "p99_us"}
        assert rec["features_per_s"] > 0 and rec["p99_us"] >= rec["p50_us"] > 0
    assert {(rec["size"], rec["consumers"]) for rec in records if rec["mode"] == "pool_view"} == {(65536, 2)}
    for rec in records:  # CPU per feature: every data-plane mode has it; only pool modes load the daemon
        if rec["mode"] in ("floor", "pool_view", "pool_copy", "zmq_bytes", "torch_mp", "inline", "client_default"):
            assert rec["producer_cpu_us"] > 0 and rec["consumer_cpu_us"] > 0 and rec["daemon_cpu_us"] is not None
        if rec["mode"] == "pool_view":
            assert rec["daemon_cpu_us"] > 0
    assert "targets:" in r.stdout and "control plane" in r.stdout
    assert "consumers ack with wait=False" in r.stdout and "CPU us per feature" in r.stdout
    assert "unacknowledged" not in r.stderr, "a background ack never reached the bench's daemon"


def test_bench_sync_acks(tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mmfeat.client", "bench", "--sizes", "64K", "--consumers", "1", "--count", "12",
         "--modes", "pool_view", "--ack", "sync", "--control-clients", ""],
        capture_output=True, text=True, timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "consumers ack and wait" in r.stdout and " pool_view " in r.stdout
    assert "unacknowledged" not in r.stderr
