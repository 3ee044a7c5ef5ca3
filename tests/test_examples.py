"""The examples run as shipped: real processes, a real daemon, and (for server.py) a real image processor."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _left_behind(stdout: str, label: str) -> Path:
    """The temporary dir an example announced on stdout; it must be gone once the example exits."""
    found = re.search(rf"{label}: (/tmp/mmfeat-[^ ]+) \(removed at the end\)", stdout)
    assert found, f"the example did not say which {label} it made:\n{stdout[-2000:]}"
    return Path(found.group(1))


def test_demo_moves_features_and_leaves_nothing_in_tmp() -> None:
    r = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "every byte checked" in r.stdout and "pool" in r.stdout
    assert not _left_behind(r.stdout, "daemon's runtime dir").exists()


def test_make_demo_installs_no_extra() -> None:
    """The demo and the daemon need torch and the package only: on a fresh machine `make demo` must not
    pull [cuda], [mesh] (NIXL and a CUDA runtime) or [examples] (transformers)."""
    out = subprocess.run(["make", "-n", "demo", "VENV=/nonexistent/venv"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    installs = [line for line in out.splitlines() if "pip install" in line]
    assert len(installs) == 2 and installs[-1].endswith("-e ."), installs
    assert not any("[" in line or "index-url" in line for line in installs), installs
    index = "https://download.pytorch.org/whl/cpu"
    cpu = subprocess.run(["make", "-n", "demo", "VENV=/nonexistent/venv", f"TORCH_INDEX={index}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, check=True).stdout
    assert any(f"--index-url {index}" in line and "torch" in line for line in cpu.splitlines()), cpu


def test_server_example_moves_identical_pixels_and_empties_the_pool(tmp_path) -> None:
    """The mmfeat mode only: the pickle mode is the baseline the docs' runs compare against, plain
    send_pyobj/recv_pyobj, and running it here would add a third of this file's time to make test."""
    pytest.importorskip("transformers", reason="the [examples] extra is not installed (make setup installs it)")
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(REPO / "examples" / "server.py"), "--requests", "4", "--tp", "2",
                        "--max-images", "2",
                        "--modes", "mmfeat", "--pool-mb", "256", "--timeout", "300", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["mode"] for row in result["rows"]] == ["mmfeat"]
    assert all(row["identical"] and row["requests"] == 4 for row in result["rows"])
    assert result["pool_used_after"] == 0
    assert "every rank's pixel values identical" in r.stdout
    assert not _left_behind(r.stdout, "work dir").exists()


def test_server_example_across_two_nodes_pulls_for_the_far_rank_and_empties_both_pools(tmp_path) -> None:
    """--nodes 2: rank 1's daemon is another node's; it pulls each feature, relays rank 1's acks, and both
    pools end empty (the owner's features and the pulled copies)."""
    pytest.importorskip("transformers", reason="the [examples] extra is not installed (make setup installs it)")
    pytest.importorskip("nixl_cu12._api", reason="NIXL is not installed: make setup installs mmfeat[mesh]")
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(REPO / "examples" / "server.py"), "--requests", "4", "--tp", "2",
                        "--max-images", "2", "--nodes", "2", "--modes", "mmfeat", "--pool-mb", "256",
                        "--timeout", "300", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (row["mode"], row["nodes"], row["requests"], row["identical"]) == ("mmfeat", 2, 4, True)
    assert result["pool_used_after"] == 0 and result["pulls"] >= 4  # rank 1 read every request from a copy
    assert "TP=2 over 2 nodes" in r.stdout
    assert not _left_behind(r.stdout, "work dir").exists()  # it held both nodes' mesh secret keys
