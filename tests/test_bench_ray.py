"""`mmfeat bench`'s ray mode: a row like every other mode's where Ray is installed, a clear refusal where not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmfeat.bench.ray_mode import ray_missing

# Runs mmfeat's CLI in a Python where `import ray` fails as it does where Ray is not installed: a finder
# ahead of every other one refuses the name, whatever this environment has.
_WITHOUT_RAY = """
import sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoRay())
from mmfeat.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _ray_session_pids() -> set[int]:
    """Ray node processes of any bench's private Ray (its session lives in the bench's mmfb- temp dir)."""
    out = set()
    for entry in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"/mmfb-" in cmd and (b"raylet" in cmd or b"gcs_server" in cmd or b"default_worker" in cmd):
            out.add(int(entry))
    return out


@pytest.mark.skipif(ray_missing() is not None, reason=f"{ray_missing()}: pip install 'mmfeat[ray]' runs this test")
def test_ray_mode_fills_the_same_row_as_the_other_modes(tmp_path) -> None:
    out = tmp_path / "bench.json"
    before = _ray_session_pids()
    r = subprocess.run(
        [sys.executable, "-m", "mmfeat.cli", "bench", "--modes", "ray,zmq_bytes", "--sizes", "64K", "--consumers", "1",
         "--count", "20", "--control-clients", "", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    records = {rec["mode"]: rec for rec in json.loads(out.read_text())}
    assert set(records) == {"memcpy", "ray", "zmq_bytes"}
    ray = records["ray"]
    assert (ray["size"], ray["consumers"]) == (65536, 1)
    assert ray["features_per_s"] > 0 and ray["gb_per_s"] > 0 and ray["p99_us"] >= ray["p50_us"] > 0
    assert ray["held_p99_us"] >= ray["held_p50_us"] > 0  # the latency table's row
    assert ray["x_zmq"] > 0 and ray["x_limit"] > 0
    # Driver, consumer actors, Ray's own processes: each column measured, none left blank.
    assert ray["producer_cpu_us"] > 0 and ray["consumer_cpu_us"] > 0 and ray["daemon_cpu_us"] > 0
    held = r.stdout.split("latency: put -> first consumer holds the tensor (us)", 1)[1]
    assert " ray " in held and " zmq_bytes " in held
    assert "Ray's own processes" in r.stdout
    # Ray started privately and was shut down with the bench: none of its processes outlive it.
    assert _ray_session_pids() <= before


def test_asking_for_ray_without_ray_says_how_to_install_it() -> None:
    r = subprocess.run(
        [sys.executable, "-c", _WITHOUT_RAY, "bench", "--modes", "ray,zmq_bytes", "--sizes", "64K", "--consumers", "1",
         "--control-clients", ""],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode != 0
    assert "the ray mode needs Ray" in r.stderr and "pip install 'mmfeat[ray]'" in r.stderr, r.stderr[-2000:]
    assert "bench: 1 consumer(s)" not in r.stderr  # refused before any row ran


def test_the_default_modes_name_ray_only_where_it_is_installed() -> None:
    code = _WITHOUT_RAY.replace("sys.exit(main(sys.argv[1:]))",
                                "from mmfeat.bench.cli import DEFAULT_MODES; print(','.join(DEFAULT_MODES))")
    without = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert without.returncode == 0, without.stderr[-2000:]
    assert "ray" not in without.stdout.strip().split(",") and "zmq_bytes" in without.stdout
    helped = subprocess.run([sys.executable, "-c", _WITHOUT_RAY, "bench", "--help"], capture_output=True, text=True,
                            timeout=300)
    assert "and ray where Ray is installed" in " ".join(helped.stdout.split())
    from mmfeat.bench.cli import DEFAULT_MODES

    assert ("ray" in DEFAULT_MODES) == (ray_missing() is None)
