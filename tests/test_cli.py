"""The mmfeatd and mmfeat command lines, as an operator runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _run(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_invalid_settings_exit_nonzero_naming_the_setting(runtime_dir) -> None:
    r = _run("-m", "mmfeat.daemon", "--runtime-dir", str(runtime_dir), "--pool-mb", "0")
    assert r.returncode == 2 and "pool_mb" in r.stderr
    r = _run("-m", "mmfeat.daemon", "--runtime-dir", str(runtime_dir), env={"MMFEAT_ACK_TTL": "soon"})
    assert r.returncode == 2 and "ack_ttl" in r.stderr and "MMFEAT_ACK_TTL" in r.stderr
    r = _run("-m", "mmfeat.daemon", "--config", str(runtime_dir / "missing.toml"))
    assert r.returncode == 2 and "missing.toml" in r.stderr


def test_pool_too_big_for_the_machine_fails_at_start(runtime_dir) -> None:
    r = _run("-m", "mmfeat.daemon", "--runtime-dir", str(runtime_dir), "--backend", "host", "--pool-mb", str(4 << 20))
    assert r.returncode == 1 and "pool_mb" in r.stderr
    assert not (runtime_dir / "mmfeatd.sock").exists()


def test_stats_table_json_and_health(daemon) -> None:
    rd = ["--runtime-dir", str(daemon.runtime_dir)]
    r = _run("-m", "mmfeat.client", *rd, "stats", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["pools"][0]["kind"] == "host" and s["pools"][0]["capacity"] == 128 << 20
    r = _run("-m", "mmfeat.client", *rd, "stats")
    assert r.returncode == 0 and "posix_fd" in r.stdout and "reserves=0" in r.stdout
    r = _run("-m", "mmfeat.client", *rd, "health")
    assert r.returncode == 0 and r.stdout.startswith("mmfeatd ok")


def test_health_fails_without_daemon(runtime_dir) -> None:
    r = _run("-m", "mmfeat.client", "--runtime-dir", str(runtime_dir), "--timeout", "0.5", "health")
    assert r.returncode == 1 and "no mmfeatd socket" in r.stderr


def test_second_daemon_on_same_runtime_dir_refuses(daemon) -> None:
    r = _run("-m", "mmfeat.daemon", "--runtime-dir", str(daemon.runtime_dir), "--backend", "host", "--pool-mb", "8")
    assert r.returncode == 1 and "another mmfeatd" in r.stderr and "holds" in r.stderr
    assert daemon.stats()["pools"][0]["capacity"] == 128 << 20


def test_a_runtime_dir_that_is_a_file_is_called_so(runtime_dir) -> None:
    path = runtime_dir / "afile"
    path.write_text("")
    r = _run("-m", "mmfeat.daemon", "--runtime-dir", str(path), "--backend", "host", "--pool-mb", "8")
    assert r.returncode == 1 and f"runtime_dir {path} is not a directory" in r.stderr, r.stderr
    assert "File exists" not in r.stderr


def test_make_test_passes_args_to_pytest() -> None:
    from pathlib import Path

    r = subprocess.run(["make", "-n", "test", "ARGS=-k mesh --durations 20"], capture_output=True, text=True,
                       timeout=30, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0, r.stderr
    (line,) = [line for line in r.stdout.splitlines() if "-m pytest" in line]
    assert line.endswith("--dist loadfile -k mesh --durations 20"), line
