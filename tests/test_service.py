"""Running as a service: systemd notify, reload, drain, metrics, logs, and the deploy files."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mmfeat.client import Client
from mmfeat.client.link.channel import ControlChannel
from mmfeat.testing import free_tcp_port
from mmfeat.daemon.config import HELP, Settings, load_settings, tomllib
from mmfeat.daemon.sd_notify import Notifier
from mmfeat.protos.codec import decode, encode
from mmfeat.protos.version import PROTOCOL_VERSION

from .conftest import start_daemon

DEPLOY = Path(__file__).parent.parent / "deploy"


def _free_port() -> int:
    return free_tcp_port()


def _finish(d) -> tuple[int, str]:
    rc = d.stop()
    _, err = d.proc.communicate()
    return rc, err


# --- systemd -------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_unit_file_verifies(tmp_path) -> None:
    unit = (DEPLOY / "mmfeatd.service").read_text()
    # verify checks that ExecStart exists: point it at this checkout's mmfeatd.
    mmfeatd = Path(sys.executable).parent / "mmfeatd"
    unit = unit.replace("/opt/mmfeat/bin/mmfeatd", str(mmfeatd))
    path = tmp_path / "mmfeatd.service"
    path.write_text(unit)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=300)
    problems = [line for line in r.stderr.splitlines() if "mmfeatd.service" in line]
    assert r.returncode == 0 and not problems, r.stderr
    for needed in ("Type=notify", "RuntimeDirectory=mmfeat", "Restart=on-failure", "LimitNOFILE=", "ExecReload=",
                   "WatchdogSec=", "DeviceAllow=char-nvidia-frontend", "DeviceAllow=char-nvidia-caps-imex-channels"):
        assert needed in unit, needed


def test_sd_notify_ready_status_watchdog_stopping_in_order(runtime_dir) -> None:
    sock_path = runtime_dir / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(sock_path))
    listener.settimeout(60)
    d = start_daemon(runtime_dir, "--pool-mb", "8", env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "600000"})
    messages, pings = [], []
    try:
        deadline = time.monotonic() + 60
        while len(pings) < 6 and time.monotonic() < deadline:
            messages.append(listener.recv(4096).decode())
            if "WATCHDOG=1" in messages[-1]:
                pings.append(time.monotonic())
        d.proc.send_signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in messages):
            messages.append(listener.recv(4096).decode())
        assert d.proc.wait(10) == 0
    finally:
        listener.close()
        if d.proc.poll() is None:
            d.proc.kill()
        d.proc.communicate()
    first = messages[0].splitlines()
    assert ("READY=1" in first and any(line.startswith("STATUS=serving") for line in first)
            and f"MAINPID={d.pid}" in first)
    kinds = ["READY" if "READY=1" in m else "WATCHDOG" if "WATCHDOG=1" in m
             else "STOPPING" if "STOPPING=1" in m else "STATUS"
             for m in messages]
    assert kinds[0] == "READY" and kinds[-1] == "STOPPING" and kinds.count("WATCHDOG") >= 6
    # Every 0.3 s (half of WATCHDOG_USEC), also while idle: an idle loop that slept its full second
    # between pings would get the daemon killed by systemd. The median forgives a loaded machine's stall.
    gaps = sorted(b - a for a, b in zip(pings, pings[1:]))
    assert gaps[len(gaps) // 2] < 0.6, gaps
    assert "STOPPING" not in kinds[:-1]


def test_notifier_abstract_socket_and_watchdog_pid() -> None:
    name = f"mmfeat-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())})
        assert n.watchdog_interval == 2.0
        assert n.status("hello")
        assert s.recv(100) == b"STATUS=hello"
        n.close()
    finally:
        s.close()
    assert Notifier({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_interval is None  # not ours
    assert not Notifier({}).enabled and not Notifier({}).ready("x")


# --- reload and drain ----------------------------------------------------------------------------


def _hello_ttls(runtime_dir) -> tuple[float, float]:
    from mmfeat.client.link.channel import ControlChannel

    ch = ControlChannel(f"ipc://{runtime_dir}/mmfeatd.sock", 5)
    try:
        h = ch.call("hello")
        return h["reserve_ttl"], h["ack_ttl"]
    finally:
        ch.close()


def test_sighup_reloads_what_it_can_and_logs_it(runtime_dir) -> None:
    cfg = runtime_dir / "m.toml"
    cfg.write_text('[mmfeatd]\npool_mb = 8\nack_ttl = 300.0\nlog_level = "INFO"\n')
    d = start_daemon(runtime_dir, "--config", str(cfg))
    try:
        assert _hello_ttls(runtime_dir) == (30.0, 300.0)
        cfg.write_text('[mmfeatd]\npool_mb = 16\nack_ttl = 0.4\nreserve_ttl = 7.0\nlog_level = "DEBUG"\n')
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while _hello_ttls(runtime_dir) != (7.0, 0.4):
            assert time.monotonic() < deadline, "reload did not apply"
            time.sleep(0.05)
        assert d.pool()["capacity"] == 8 << 20  # pool_mb needs a restart
        with d.client(inline_threshold=0) as c:
            c.put(torch.ones(1000), consumers=1)  # never acked: the new ack_ttl frees it
        d.wait_for(lambda s: s["counters"]["expired"] == 1, what="expiry under the reloaded ack_ttl")
        cfg.write_text("[mmfeatd]\npool_mb = oops\n")
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert _hello_ttls(runtime_dir) == (7.0, 0.4), "a bad file must not change anything"
    finally:
        rc, err = _finish(d)
    assert rc == 0
    assert re.search(r"reloaded: .*ack_ttl 300.0 -> 0.4", err) and "log_level INFO -> DEBUG" in err
    assert "not applied until a restart: pool_mb" in err
    assert "reload failed, keeping the running settings" in err


def test_sigterm_drains_then_exits_when_acked(runtime_dir) -> None:
    d = start_daemon(runtime_dir, "--pool-mb", "8", "--drain-timeout", "120")
    with d.client(inline_threshold=0) as producer, d.client() as consumer:
        desc = producer.put(torch.arange(1000), consumers=1)
        d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not producer.ping()["draining"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        late = producer.put(torch.arange(1000))
        assert late.is_inline and producer.fallbacks["draining"] == 1
        assert d.proc.poll() is None, "the daemon quit before the published lease was acknowledged"
        assert torch.equal(consumer.get(desc), torch.arange(1000))
        consumer.ack(desc)
    try:
        assert d.proc.wait(30) == 0
    except subprocess.TimeoutExpired:
        pytest.fail("the daemon waits out drain_timeout although nothing is left to acknowledge")
    _, err = d.proc.communicate()
    assert "draining: refusing new reserves; 1 lease(s) live" in err
    assert "stopped: every lease was acknowledged" in err
    assert not (runtime_dir / "mmfeatd.sock").exists() and not (runtime_dir / "mmfeatd.fds.sock").exists()


def test_the_ack_that_ends_a_drain_is_answered(runtime_dir) -> None:
    # The daemon exits right after answering the ack that freed its last lease. The client must still
    # read that reply after the connection closed (ZMQ_IMMEDIATE on the DEALER used to drop it). The
    # ack goes out on the channel's own socket without waiting, so the reply is certainly unread when
    # the daemon exits.
    d = start_daemon(runtime_dir, "--pool-mb", "8", "--drain-timeout", "20")
    with d.client(inline_threshold=0) as producer:
        desc = producer.put(torch.arange(10), consumers=1)
        channel = ControlChannel(producer.endpoint, timeout=5.0)
        channel.call("ping")
        d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not channel.call("ping")["draining"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        channel.send_frame(encode({"v": PROTOCOL_VERSION, "op": "ack", "id": 99, "lease": desc.lease_ref(),
                                   "count": 1}))
        assert d.proc.wait(10) == 0
        time.sleep(0.2)  # the daemon's close reaches our side before we read
        reply = channel.receive_frame(2.0)
        assert reply is not None, "the reply to the last ack was lost"
        assert decode(reply)["freed"] is True
        channel.close()
    d.proc.communicate()


def test_drain_timeout_cuts_and_says_how_many(runtime_dir) -> None:
    d = start_daemon(runtime_dir, "--pool-mb", "8", "--drain-timeout", "0.5")
    with d.client(inline_threshold=0) as producer:
        producer.put(torch.arange(1000), consumers=2)
        producer.put(torch.arange(1000), consumers=1)
    rc, err = _finish(d)
    assert rc == 0
    assert "drain ended with 2 lease(s) unacknowledged; they were cut" in err


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_endpoint_parses_with_prometheus_client(runtime_dir) -> None:
    port = _free_port()
    # --drain-timeout 0: one lease stays
    d = start_daemon(runtime_dir, "--pool-mb", "8", "--metrics-port", str(port), "--drain-timeout", "0")
    try:
        with d.client(inline_threshold=0) as c:
            for _ in range(3):
                desc = c.put(torch.ones(5000), consumers=2)
                c.get(desc)
                c.ack(desc, count=3)  # one over-ack each
            c.put(torch.ones(100), consumers=1)  # stays published
        families = {}
        deadline = time.monotonic() + 60
        while True:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            # The snapshot refreshes every 0.5 s: wait for one taken after the last (pipelined) publish.
            if all(families.get(n) and families[n].samples[0].value == 4
                   for n in ("mmfeat_arena_publishes", "mmfeat_publishes")):
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
    finally:
        rc, _ = _finish(d)
    assert rc == 0
    assert all(name.startswith("mmfeat_") for name in families)
    # The Grafana dashboard queries only series this daemon exports.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    samples = {f.name + suffix for f in families.values() for suffix in suffixes.get(f.type, ("",))}
    dashboard = json.loads((DEPLOY / "grafana" / "mmfeat.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for metric in re.findall(r"mmfeat_[a-z_]+", target["expr"]):
                assert metric in samples, f"panel {panel['title']!r} queries {metric}, which the daemon does not export"
    # So does the integration guide's list of what to watch.
    guide = (DEPLOY.parent / "docs" / "integration.md").read_text()
    for metric in re.findall(r"`(mmfeat_[a-z_]+)", guide):
        assert metric in samples or families.get(metric, None) is not None and families[metric].type == "histogram", (
            f"docs/integration.md names {metric}, which the daemon does not export")
    value = {(f.name, tuple(sorted(s.labels.items())), s.name): s.value for f in families.values() for s in f.samples}
    assert value[("mmfeat_over_acks", (), "mmfeat_over_acks_total")] == 3
    assert value[("mmfeat_leases", (("pool", "0"), ("state", "published")), "mmfeat_leases")] == 1
    assert value[("mmfeat_pool_capacity_bytes", (("device", "-1"), ("kind", "host"), ("pool", "0")),
                  "mmfeat_pool_capacity_bytes")] == 8 << 20
    assert value[("mmfeat_pool_bytes", (("device", "-1"), ("kind", "host"), ("pool", "0"), ("state", "published")),
                  "mmfeat_pool_bytes")] == 512
    assert value[("mmfeat_publish_to_last_ack_seconds", (), "mmfeat_publish_to_last_ack_seconds_count")] == 3
    # Every feature went into the client's arena: no reserve round trip, four adopted by the sweep.
    assert value[("mmfeat_reserve_seconds", (), "mmfeat_reserve_seconds_count")] == 0
    assert value[("mmfeat_arena_publishes", (), "mmfeat_arena_publishes_total")] == 4
    assert value[("mmfeat_arena_bytes", (("device", "-1"), ("kind", "host"), ("part", "live_bytes"), ("pool", "0")),
                  "mmfeat_arena_bytes")] == 512
    for name in ("mmfeat_expired", "mmfeat_reclaimed_on_disconnect", "mmfeat_sessions_dropped", "mmfeat_forbidden",
                 "mmfeat_bad_requests", "mmfeat_clients", "mmfeat_client_fallbacks"):
        assert name in families, name


# --- logs, config, CLI ---------------------------------------------------------------------------


def test_journal_level_prefixes_and_quiet_info(runtime_dir, tmp_path) -> None:
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err:
        st = os.fstat(err.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        proc = subprocess.Popen([sys.executable, "-m", "mmfeat.daemon", "--runtime-dir", str(runtime_dir),
                                 "--backend", "host", "--pool-mb", "8"], stderr=err, env=env)
        try:
            deadline = time.monotonic() + 300  # a busy machine takes many seconds to start it
            while "serving ipc://" not in err_path.read_text():  # the last line logged at start
                assert time.monotonic() < deadline
                time.sleep(0.05)
            before = err_path.read_text()
            with Client(runtime_dir, inline_threshold=0) as c:
                for _ in range(50):
                    c.ack(c.put(torch.ones(1000)))
            assert err_path.read_text() == before, "something is logged per request at INFO"
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
    lines = err_path.read_text().splitlines()
    assert lines and all(re.match(r"<[2-7]>mmfeatd", line) for line in lines), lines


def test_deploy_toml_documents_every_setting_with_its_default() -> None:
    text = (DEPLOY / "mmfeatd.toml").read_text()
    for name in HELP:
        assert re.search(rf"^#? ?{name} = ", text, re.M), f"{name} missing from deploy/mmfeatd.toml"
    settings, sources = load_settings(DEPLOY / "mmfeatd.toml", {}, environ={})
    defaults = Settings()
    for name in HELP:
        if name not in ("runtime_dir", "node_id"):
            assert getattr(settings, name) == getattr(defaults, name), name
    assert set(tomllib.loads(text)["mmfeatd"]) == set(HELP) - {"runtime_dir", "node_id", "mesh_secret_file",
                                                               "peers_dir", "keys_dir"}


def test_print_config_names_sources(tmp_path) -> None:
    cfg = tmp_path / "m.toml"
    cfg.write_text("[mmfeatd]\nack_ttl = 12.0\n")
    r = subprocess.run([sys.executable, "-m", "mmfeat.daemon", "--config", str(cfg), "--pool-mb", "64",
                        "--print-config"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "MMFEAT_RESERVE_TTL": "9"})
    assert r.returncode == 0, r.stderr
    assert "pool_mb = 64  # from flag" in r.stdout
    assert f"ack_ttl = 12.0  # from file {cfg}" in r.stdout
    assert "reserve_ttl = 9.0  # from environment MMFEAT_RESERVE_TTL" in r.stdout
    assert "drain_timeout = 10.0  # from default" in r.stdout


def test_stats_watch_redraws_in_place(daemon) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mmfeat.cli", "--runtime-dir", str(daemon.runtime_dir), "stats",
                             "--watch", "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    out = b""
    deadline = time.monotonic() + 300  # a loaded machine may take a minute to start the CLI
    while out.count(b"posix_fd") < 3:
        assert proc.poll() is None and time.monotonic() < deadline, out
        try:
            out += os.read(proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert (out + rest).count(b"\x1b[H\x1b[J") >= 3


def test_kubernetes_and_prometheus_files_match_the_daemon() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text()))
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    cfg = tomllib.loads(cm["data"]["mmfeatd.toml"])["mmfeatd"]
    Settings(**cfg)  # the ConfigMap's settings are valid
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert "--runtime-dir" in c["args"] and c["args"][c["args"].index("--runtime-dir") + 1] == "/run/mmfeat"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert mounts["runtime"] == "/run/mmfeat" and vols["runtime"]["hostPath"]["path"] == "/run/mmfeat"
    assert c["ports"][0]["containerPort"] == cfg["metrics_port"] == 9464
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]
    limit_mib = int(c["resources"]["limits"]["memory"].removesuffix("Mi"))
    assert limit_mib > cfg["pool_mb"], "the container's memory limit must cover a host pool"
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["localhost:9464"]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"MmfeatdDown", "MmfeatPoolNearlyFull", "MmfeatLeasesExpiring"} <= names
    exported = {"mmfeat_pool_bytes", "mmfeat_pool_capacity_bytes", "mmfeat_expired_total",
                "mmfeat_client_fallbacks_total", "mmfeat_leases", "mmfeat_sessions_dropped_total",
                "mmfeat_mesh_peers", "mmfeat_mesh_transport_up", "mmfeat_mesh_quorum"}
    for r in rules:
        for metric in re.findall(r"mmfeat_[a-z_]+", r["expr"]):
            assert metric in exported, f"alert {r['alert']} uses {metric}, which the daemon does not export"


def test_the_kubernetes_files_apply_as_shipped() -> None:
    """kubectl apply -f deploy/kubernetes/ on an empty cluster: the namespace the objects name is among
    them, the init step runs the daemon's own image, and each probe gives its CLI more than its --timeout
    (Kubernetes' default timeoutSeconds is 1 s)."""
    paths = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    docs = [d for path in paths for d in yaml.safe_load_all(path.read_text()) if d]
    namespaces = {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
    assert {d["metadata"]["namespace"] for d in docs if "namespace" in d["metadata"]} <= namespaces
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert {i["image"] for i in pod["initContainers"]} == {c["image"]}
    for kind in ("readinessProbe", "livenessProbe"):
        argv = c[kind]["exec"]["command"]
        waits = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 3.0
        assert c[kind].get("timeoutSeconds", 1) >= waits + 5, f"{kind}: the kubelet gives up before the probe does"


def test_the_readme_installs_mmfeatd_where_the_unit_runs_it() -> None:
    """The unit works as shipped only if the steps in README.md and docs/operations.md put mmfeatd at its ExecStart."""
    execstart = re.search(r"^ExecStart=(\S+)", (DEPLOY / "mmfeatd.service").read_text(), re.M).group(1)
    prefix = Path(execstart).parent.parent
    assert execstart.endswith("/bin/mmfeatd")
    for doc in (DEPLOY.parent / "README.md", DEPLOY.parent / "docs" / "operations.md"):
        text = doc.read_text()
        assert re.search(rf"python3 -m venv {re.escape(str(prefix))}\s", text), doc.name
        assert f"sudo {prefix}/bin/pip install" in text, doc.name


def test_the_systemd_unit_verifies(tmp_path) -> None:
    """systemd-analyze accepts the shipped unit without a single complaint (an unknown key is only a
    warning to systemd, and a silent no-op in production)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    mmfeatd = Path(sys.executable).parent / "mmfeatd"
    unit = tmp_path / "mmfeatd.service"
    # The unit names the installed entry point; verify checks that it exists, so point it at ours.
    unit.write_text((DEPLOY / "mmfeatd.service").read_text().replace("/opt/mmfeat/bin/mmfeatd", str(mmfeatd)))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=300)
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 0 and not complaints, complaints
    # The mesh's drop-in, where the README says to install it (verify reads drop-ins beside the unit).
    dropin = DEPLOY / "mmfeatd-mesh.conf"
    (tmp_path / "mmfeatd.service.d").mkdir()
    (tmp_path / "mmfeatd.service.d" / "mesh.conf").write_text(dropin.read_text())
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=300)
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 0 and not complaints, complaints
    assert "LoadCredential=mesh.secret:/etc/mmfeat/mesh.secret" in dropin.read_text()
    assert "\nLoadCredential" not in unit.read_text()  # a node without a mesh has no key to load

