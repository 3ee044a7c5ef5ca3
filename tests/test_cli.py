"""The mmfeatd and mmfeat command lines, as an operator runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


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
    r = _run("-m", "mmfeat.cli", *rd, "stats", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["pools"][0]["kind"] == "host" and s["pools"][0]["capacity"] == 128 << 20
    r = _run("-m", "mmfeat.cli", *rd, "stats")
    assert r.returncode == 0 and "posix_fd" in r.stdout and "reserves=0" in r.stdout
    r = _run("-m", "mmfeat.cli", *rd, "health")
    assert r.returncode == 0 and r.stdout.startswith("mmfeatd ok")


def test_health_fails_without_daemon(runtime_dir) -> None:
    r = _run("-m", "mmfeat.cli", "--runtime-dir", str(runtime_dir), "--timeout", "0.5", "health")
    assert r.returncode == 1 and "no mmfeatd socket" in r.stderr


def test_second_daemon_on_same_runtime_dir_refuses(daemon) -> None:
    r = _run("-m", "mmfeat.daemon", "--runtime-dir", str(daemon.runtime_dir), "--backend", "host", "--pool-mb", "8")
    assert r.returncode == 1 and "another mmfeatd" in r.stderr and "holds" in r.stderr
    assert daemon.stats()["pools"][0]["capacity"] == 128 << 20


def _options(help_text: str) -> dict[str, str]:
    """`--help` output as {invocation: its help text}, e.g. {'--pool-mb POOL_MB': 'pool size ... (default: 1024)'}."""
    options: dict[str, str] = {}
    current = None
    for line in help_text.split("options:\n", 1)[1].splitlines():
        if line.startswith("  -"):
            invocation, _, text = line.strip().partition("  ")
            current = invocation
            options[current] = text.strip()
        elif line.startswith("    ") and current is not None:
            options[current] = (options[current] + " " + line.strip()).strip()
        else:
            current = None
    return options


@pytest.mark.parametrize("command", [("mmfeat.daemon",), ("mmfeat.cli", "bench"), ("mmfeat.cli",),
                                     ("mmfeat.cli", "stats")])
def test_every_flag_says_what_it_does_and_its_default(command) -> None:
    r = _run("-m", *command, "--help", env={"COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    options = _options(r.stdout)
    assert len(options) > 2, r.stdout
    for invocation, text in options.items():
        assert text, f"{invocation} has no help text"
        takes_value = not invocation.split()[-1].startswith("-")
        if takes_value and not text.endswith("and exit"):  # an action (--gen-keys DIR) has no default
            assert "default" in text, f"{invocation} does not say its default: {text!r}"
    if command == ("mmfeat.daemon",):
        from mmfeat.daemon.config import HELP

        flags = {inv.split()[0]: text for inv, text in options.items()}
        for name, help_text in HELP.items():
            flag = "--" + name.replace("_", "-")
            if flag in flags:  # the help comes from config.py, the one place a setting is described
                assert flags[flag].startswith(" ".join(help_text.split())), (flag, flags[flag])
        assert "(default: 1024)" in flags["--pool-mb"] and "(default: 64)" in flags["--arena-mb"]


def test_a_prefix_of_a_flag_is_not_taken_for_it() -> None:
    r = _run("-m", "mmfeat.daemon", "--pool", "10", "--print-config")
    assert r.returncode == 2 and "unrecognized arguments: --pool 10" in r.stderr, r.stderr
    from mmfeat.cli import parser

    for argv in (["--time", "1", "health"], ["stats", "--inter", "2"], ["bench", "--size", "64K"]):
        with pytest.raises(SystemExit) as info:
            parser().parse_args(argv)
        assert info.value.code == 2, argv


def test_print_config_says_the_arena_size_the_daemon_uses_and_why() -> None:
    r = _run("-m", "mmfeat.daemon", "--pool-mb", "256", "--arena-mb", "1000", "--print-config")
    assert r.returncode == 0, r.stderr
    assert "arena_mb = 1000  # from flag" in r.stdout
    assert ("# effective arena_mb: 16, not 1000: an arena takes at most a sixteenth of the pool (pool_mb = 256)"
            in r.stdout)
    r = _run("-m", "mmfeat.daemon", "--pool-mb", "256", "--arena-mb", "16", "--print-config")
    assert r.returncode == 0 and "effective" not in r.stdout


def test_a_daemon_warns_at_start_about_an_arena_size_it_cannot_use(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "16", "--arena-mb", "100")
    assert d.stop() == 0
    err = d.proc.communicate()[1]
    assert "WARNING mmfeatd: arena_mb: 1, not 100: an arena takes at most a sixteenth of the pool" in err, err


def test_a_bound_in_an_error_has_its_unit() -> None:
    r = _run("-m", "mmfeat.daemon", "--pool-mb", "999999999", "--print-config")
    assert r.returncode == 2 and "less than or equal to 4194304 MiB, not 999999999" in r.stderr, r.stderr
    r = _run("-m", "mmfeat.daemon", "--ack-ttl", "0", "--print-config")
    assert r.returncode == 2 and "greater than 0 seconds" in r.stderr, r.stderr


def test_a_runtime_dir_that_is_a_file_is_called_so(runtime_dir) -> None:
    path = runtime_dir / "afile"
    path.write_text("")
    r = _run("-m", "mmfeat.daemon", "--runtime-dir", str(path), "--backend", "host", "--pool-mb", "8")
    assert r.returncode == 1 and f"runtime_dir {path} is not a directory" in r.stderr, r.stderr
    assert "File exists" not in r.stderr


TYPO = "MMFEAT_" + "POOLMB"  # spelled in two parts, so that the scan below does not find it


def test_an_mmfeat_variable_nothing_reads_is_warned_about() -> None:
    from mmfeat.protos.env import READ_OUTSIDE_SETTINGS

    read = {var: "1" for var in READ_OUTSIDE_SETTINGS if var != "MMFEAT_RUNTIME_DIR"}
    r = _run("-m", "mmfeat.daemon", "--print-config", env={TYPO: "2048", "MMFEAT_ACK_TTL": "60", **read})
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, r.stderr  # the client's, the tests' and the settings' names are not flagged
    assert f"mmfeatd: warning: {TYPO} is set but neither mmfeatd nor its clients read it" in warnings[0]
    assert "did you mean MMFEAT_POOL_MB?" in warnings[0]
    assert "pool_mb = 1024  # from default" in r.stdout


def test_every_mmfeat_variable_in_the_sources_is_known_to_the_daemon() -> None:
    """The daemon's warning must not flag a name the client, the shared package or the tests read."""
    import re
    from pathlib import Path

    from mmfeat.daemon.config import ENV_PREFIX, HELP
    from mmfeat.protos.env import READ_OUTSIDE_SETTINGS

    known = {ENV_PREFIX + name.upper() for name in HELP} | READ_OUTSIDE_SETTINGS
    root = Path(__file__).parent.parent
    for part in ("client", "daemon", "protos", "mmfeat_pkg", "tests", "examples"):
        for path in (root / part).rglob("*.py"):
            for var in set(re.findall(r"\bMMFEAT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())):
                assert var in known, f"{path.relative_to(root)} reads {var}: add it to protos/env.py"


def test_make_test_passes_args_to_pytest() -> None:
    from pathlib import Path

    r = subprocess.run(["make", "-n", "test", "ARGS=-k mesh --durations 20"], capture_output=True, text=True,
                       timeout=30, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0, r.stderr
    (line,) = [line for line in r.stdout.splitlines() if "-m pytest" in line]
    assert line.endswith("--dist loadfile -k mesh --durations 20"), line


def test_plot_without_matplotlib_fails_before_the_bench_runs(tmp_path) -> None:
    blocker = tmp_path / "no-mpl" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    r = _run("-m", "mmfeat.cli", "bench", "--sizes", "64K", "--consumers", "1", "--count", "2",
             "--modes", "pool_view", "--control-clients", "", "--plot", str(tmp_path / "out.png"),
             env={"PYTHONPATH": os.pathsep.join(filter(None, [str(blocker.parent), os.environ.get("PYTHONPATH")]))},
             timeout=240)
    assert r.returncode != 0 and "cannot --plot: matplotlib is not installed" in r.stderr, (r.stdout, r.stderr)
    assert "bench: 1 consumer" not in r.stderr and "pool_view" not in r.stdout, "the bench ran before the check"
