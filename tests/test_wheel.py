"""The package as a wheel, outside this checkout: what a node that runs `pip install mmfeat` gets."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_USE = """
import sys, torch
from pathlib import Path
site = sys.argv[2]
import mmfeat.client, mmfeat.daemon, mmfeat.protos
for m in (mmfeat.client, mmfeat.daemon, mmfeat.protos):
    assert m.__file__.startswith(site), f"{m.__name__} came from {m.__file__}, not the wheel"
from mmfeat.client import Client
from mmfeat.client.daemon_process import spawn_daemon
from importlib.resources import files
assert "Protocol version" in files("mmfeat.protos").joinpath("SPEC.md").read_text()  # package data
d = spawn_daemon(Path(sys.argv[1]), ["--pool-mb", "16", "--backend", "host"])
try:
    with Client(sys.argv[1], inline_threshold=0) as c:
        x = torch.arange(50_000, dtype=torch.float32)
        desc = c.put(x)
        assert not desc.is_inline and torch.equal(c.get(desc), x)
        c.ack(desc)
    print("wheel ok")
finally:
    d.terminate()
    assert d.wait(30) == 0
"""


def test_the_wheel_installs_and_serves_outside_the_checkout(tmp_path) -> None:
    src = tmp_path / "src"
    # A copy of the sources alone: a build/ left in the checkout could put stale modules in the wheel.
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__", ".whl",
                                                             ".pytest_cache", "dist"))
    dist, site = tmp_path / "dist", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)], check=True, timeout=300)
    wheels = list(dist.glob("mmfeat-*.whl"))
    assert len(wheels) == 1, wheels
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheels[0])], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    config = subprocess.run([sys.executable, "-m", "mmfeat.daemon", "--print-config"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert config.returncode == 0 and "pool_mb" in config.stdout and "arena_mb" in config.stdout, config.stderr
    runtime = Path("/tmp") / f"mmf-wheel-{os.getpid()}"
    runtime.mkdir(mode=0o700)
    try:
        used = subprocess.run([sys.executable, "-c", _USE, str(runtime), str(site)], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert used.returncode == 0 and "wheel ok" in used.stdout, used.stderr[-3000:]
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
