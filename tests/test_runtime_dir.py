"""The runtime dir as a hostile user of the same machine would attack it: squatting, symlinks, a
second daemon, a fake daemon. Tests that switch uids need root (CI runs as root)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from .conftest import start_daemon

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")
OTHER_UID, CLIENT_UID = 12345, 54321
REPO = Path(__file__).resolve().parent.parent


def _run_daemon(runtime_dir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mmfeat.daemon", "--runtime-dir", str(runtime_dir), "--backend", "host",
           "--pool-mb", "8", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@needs_root
def test_a_runtime_dir_of_another_user_is_refused(runtime_dir) -> None:
    squatted = runtime_dir / "squat"
    squatted.mkdir(mode=0o750)
    os.chown(squatted, OTHER_UID, OTHER_UID)
    r = _run_daemon(squatted)
    assert r.returncode == 1 and f"belongs to uid {OTHER_UID}" in r.stderr, r.stderr
    assert not (squatted / "mmfeatd.sock").exists()


def test_a_runtime_dir_others_may_write_is_refused(runtime_dir) -> None:
    loose = runtime_dir / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    r = _run_daemon(loose)
    assert r.returncode == 1 and "others may write it" in r.stderr, r.stderr
    link = runtime_dir / "link"
    target = runtime_dir / "target"
    target.mkdir(mode=0o700)
    link.symlink_to(target)
    r = _run_daemon(link)
    assert r.returncode == 1 and "symlink is refused" in r.stderr, r.stderr


def test_socket_modes_are_set_without_following_a_planted_symlink(runtime_dir) -> None:
    victim = runtime_dir / "victim"
    victim.write_text("secret")
    os.chmod(victim, 0o600)
    (runtime_dir / "mmfeatd.sock").symlink_to(victim)
    (runtime_dir / "mmfeatd.fds.sock").symlink_to(victim)
    d = start_daemon(runtime_dir, "--pool-mb", "8")
    try:
        assert (victim.stat().st_mode & 0o777) == 0o600 and victim.read_text() == "secret"
        for name in ("mmfeatd.sock", "mmfeatd.fds.sock"):
            st = (runtime_dir / name).lstat()
            assert (st.st_mode & 0o777) == 0o660, oct(st.st_mode)
    finally:
        assert d.stop() == 0


def test_a_second_daemon_cannot_start_beside_a_stopped_one(runtime_dir) -> None:
    first = start_daemon(runtime_dir, "--pool-mb", "8")
    first.proc.send_signal(signal.SIGSTOP)
    try:
        r = _run_daemon(runtime_dir)
        assert r.returncode == 1 and f"another mmfeatd (pid {first.pid})" in r.stderr, r.stderr
    finally:
        first.proc.send_signal(signal.SIGCONT)
    with first.client(inline_threshold=0) as c:  # the first still serves, with its own sockets
        desc = c.put(torch.ones(1000))
        assert c.get(desc).sum().item() == 1000
        c.ack(desc)
    assert first.stop() == 0
    assert not (runtime_dir / "mmfeatd.sock").exists()


def test_a_daemon_unlinks_only_its_own_sockets(runtime_dir) -> None:
    d = start_daemon(runtime_dir, "--pool-mb", "8")
    # Someone replaces the socket file (as a second daemon would have, before the lock existed).
    os.rename(runtime_dir / "mmfeatd.sock", runtime_dir / "old.sock")
    (runtime_dir / "mmfeatd.sock").write_text("not ours")
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    assert (runtime_dir / "mmfeatd.sock").read_text() == "not ours"
    assert not (runtime_dir / "mmfeatd.fds.sock").exists()


_FAKE_FD_SERVER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(sys.argv[1]); s.listen(8)
print("ready", flush=True)
while True:
    conn, _ = s.accept()
    conn.settimeout(5)
    try:
        conn.recv(4096)
        conn.send(bytes.fromhex(sys.argv[2]))
    except OSError:
        pass
    conn.close()
"""


def _interpreter_for(uid: int) -> str:
    """A Python another uid may run (the test's own may live under a private home)."""
    for candidate in (sys.executable, "/usr/bin/python3"):
        try:
            if subprocess.run([candidate, "-c", "pass"], user=uid, group=uid, capture_output=True).returncode == 0:
                return candidate
        except OSError:
            continue
    pytest.skip(f"no Python interpreter that uid {uid} may run")


def _fake_daemon_as(uid: int, runtime_dir: Path) -> subprocess.Popen:
    """A stranger's fd channel: stdlib only, answers every handshake with a NOT_FOUND error."""
    import msgpack

    os.chown(runtime_dir, uid, uid)
    reply = msgpack.packb({"v": 2, "ok": False, "error": {"code": "NOT_FOUND", "message": "fake"}}).hex()
    proc = subprocess.Popen([_interpreter_for(uid), "-c", _FAKE_FD_SERVER, str(runtime_dir / "mmfeatd.fds.sock"),
                             reply],
                            user=uid, group=uid, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@needs_root
def test_clients_refuse_a_daemon_of_another_user_in_a_squatted_dir() -> None:
    from mmfeat.client.link.fd_channel import open_fd_channel
    from mmfeat.protos import ErrorCode, MmfeatError

    # /tmp/mmfeat-<uid> made by someone else: the parent is world-writable, so only the client's own
    # uid or root may serve it, and the session token is never sent to anyone else.
    squat = Path(tempfile.mkdtemp(prefix="mmf-squat-", dir="/tmp"))
    proc = _fake_daemon_as(OTHER_UID, squat)
    try:
        with pytest.raises(MmfeatError) as info:
            open_fd_channel(squat / "mmfeatd.fds.sock", b"s" * 16, 5.0)
        assert info.value.code is ErrorCode.FORBIDDEN and f"runs as uid {OTHER_UID}" in info.value.message
    finally:
        proc.kill()
        proc.wait(15)
        subprocess.run(["rm", "-rf", str(squat)])


@needs_root
def test_clients_trust_the_owner_of_a_dir_only_root_could_create() -> None:
    from mmfeat.client.link.fd_channel import open_fd_channel
    from mmfeat.protos import ErrorCode, MmfeatError

    # /run/mmfeat under systemd: owned by the daemon's user, in a parent only root may write. The
    # check passes and the handshake goes on (to the fake's own refusal).
    parent = Path(tempfile.mkdtemp(prefix="mmf-run-", dir="/tmp"))
    os.chmod(parent, 0o755)
    runtime = parent / "mmfeat"
    runtime.mkdir(mode=0o750)
    proc = _fake_daemon_as(OTHER_UID, runtime)
    try:
        with pytest.raises(MmfeatError) as info:
            open_fd_channel(runtime / "mmfeatd.fds.sock", b"s" * 16, 5.0)
        assert info.value.code is ErrorCode.NOT_FOUND and info.value.message == "fake"
    finally:
        proc.kill()
        proc.wait(15)
        subprocess.run(["rm", "-rf", str(parent)])


_FD_HANDSHAKE = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(bytes.fromhex(sys.argv[2]))
data, fds, _, _ = socket.recv_fds(s, 4096, 8)
for fd in fds:
    os.close(fd)
print(data.hex(), len(fds))
"""


@needs_root
def test_supplementary_groups_come_from_the_socket_not_from_proc(daemon_factory, runtime_dir) -> None:
    import msgpack

    from mmfeat.protos import PROTOCOL_VERSION

    os.chmod(runtime_dir, 0o755)
    d = daemon_factory("--pool-mb", "8", env={"MMFEAT_ALLOWED_GIDS": "4242", "MMFEAT_SOCKET_MODE": "0666"})
    with d.client() as c:
        hello = c.request("hello")
    payload = msgpack.packb({"v": PROTOCOL_VERSION, "session": hello["session"]}).hex()

    def handshake(groups: list[int]) -> tuple[dict, int]:
        r = subprocess.run([_interpreter_for(CLIENT_UID), "-c", _FD_HANDSHAKE, str(d.runtime_dir / "mmfeatd.fds.sock"),
                            payload], user=CLIENT_UID, group=CLIENT_UID, extra_groups=groups,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        reply_hex, nfds = r.stdout.split()
        return msgpack.unpackb(bytes.fromhex(reply_hex)), int(nfds)

    refused, nfds = handshake([])
    assert refused["ok"] is False and refused["error"]["code"] == "FORBIDDEN" and nfds == 0
    with d.client() as c:
        hello = c.request("hello")
    payload = msgpack.packb({"v": PROTOCOL_VERSION, "session": hello["session"]}).hex()
    accepted, nfds = handshake([4242])  # a member of an allowed group only through a supplementary gid
    assert accepted["ok"] is True and nfds == 2


def _daemonset_pod() -> tuple[dict, dict]:
    import yaml

    docs = list(yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "daemonset.yaml").read_text()))
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    return ds["spec"]["template"]["spec"], cm["data"]


def _on_node(argv: list[str], mount: str, host: Path) -> list[str]:
    """A container's command as the node runs it: the hostPath mount is the test's dir, the CLIs this
    checkout's."""
    argv = [a.replace(mount, str(host)) for a in argv]
    entry = {"mmfeatd": [sys.executable, "-m", "mmfeat.daemon"], "mmfeat": [sys.executable, "-m", "mmfeat.cli"]}
    return [*entry.get(argv[0], argv[:1]), *argv[1:]]


@needs_root
def test_the_daemonset_starts_on_the_runtime_dir_the_kubelet_makes() -> None:
    """The kubelet makes the hostPath (DirectoryOrCreate) owned by root, 0755; the daemon runs as the pod's
    uid and refuses a dir it does not own. The init container, as root with only its listed capabilities,
    hands the dir over (again on a restart), and the daemon as the pod's uid serves the readiness probe."""
    pod, config = _daemonset_pod()
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    daemon = pod["containers"][0]
    mount = next(m["mountPath"] for m in daemon["volumeMounts"] if m["name"] == "runtime")
    node_run = Path(tempfile.mkdtemp(prefix="mmf-node-", dir="/tmp"))  # the node's /run: root's
    os.chmod(node_run, 0o755)
    runtime = node_run / "mmfeat"
    runtime.mkdir(mode=0o755)
    conf = node_run / "mmfeatd.toml"
    conf.write_text(config["mmfeatd.toml"])
    conf.chmod(0o644)
    daemon_argv = [*_on_node(["mmfeatd", *daemon["args"]], mount, runtime), "--config", str(conf), "--backend", "host",
                   "--pool-mb", "16", "--metrics-port", "0"]  # later flags win: small, host-only, no port taken
    # The pod's uid and gid, no other group. DAC_READ_SEARCH only lets it read this test's interpreter
    # (it may live under root's private home); creating the sockets in a dir of another user needs
    # DAC_OVERRIDE, which it lacks, as the pod does.
    as_pod = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=+dac_read_search",
              "--ambient-caps=+dac_read_search"]
    proc = None
    try:
        refused = subprocess.run([*as_pod, *daemon_argv], capture_output=True, text=True, timeout=300, cwd=node_run)
        assert refused.returncode != 0, refused.stderr
        assert f"belongs to uid 0, not to this daemon's uid {uid}" in refused.stderr, refused.stderr
        inits = [c for c in pod.get("initContainers", []) if any(m["mountPath"] == mount for m in c["volumeMounts"])]
        assert inits, "no init container prepares the runtime dir the kubelet makes"
        for _ in range(2):  # the pod's first start, then a restart that finds the dir already the daemon's
            for init in inits:
                ctx = init["securityContext"]
                assert ctx["runAsUser"] == 0 and ctx["capabilities"]["drop"] == ["ALL"]
                caps = ",".join(["-all", *(f"+{c.lower()}" for c in ctx["capabilities"].get("add", []))])
                step = _on_node(init["command"], mount, runtime)
                done = subprocess.run(["setpriv", f"--bounding-set={caps}", "--inh-caps=-all", *step],
                                      capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, f"{init['name']}: {done.stderr}"
        st = runtime.stat()
        assert (st.st_uid, st.st_gid) == (uid, gid) and not st.st_mode & 0o022
        proc = subprocess.Popen([*as_pod, *daemon_argv], stderr=subprocess.PIPE, text=True, cwd=node_run)
        probe = _on_node(daemon["readinessProbe"]["exec"]["command"], mount, runtime)
        deadline = time.monotonic() + 300  # a busy machine takes many seconds to start it
        probe = [*as_pod, *probe]
        while (r := subprocess.run(probe, capture_output=True, text=True, timeout=300, cwd=node_run)).returncode:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"the daemon never answered the readiness probe: {r.stderr}"
            time.sleep(0.2)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=15)
        subprocess.run(["rm", "-rf", str(node_run)])
    assert proc.returncode == 0


_LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print("open", flush=True)
sys.stdin.readline()
fcntl.flock(fd, fcntl.LOCK_SH)
print("locked", flush=True)
sys.stdin.readline()
"""


@needs_root
def test_a_lock_file_others_could_open_is_replaced_before_they_can_hold_it(runtime_dir) -> None:
    """A lock file left readable by others (made by hand, or by a tool's umask): a user who opened it
    keeps that fd across every chmod, and once the daemon stops, flocks it and keeps every later daemon
    out. The daemon that finds it so serves from a fresh 0600 file instead."""
    os.chmod(runtime_dir, 0o755)
    lock = runtime_dir / "mmfeatd.lock"
    lock.write_text("")
    os.chmod(lock, 0o644)
    holder = subprocess.Popen([_interpreter_for(OTHER_UID), "-c", _LOCK_HOLDER, str(lock)], user=OTHER_UID,
                              group=OTHER_UID, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        first = start_daemon(runtime_dir, "--pool-mb", "8")
        assert lock.stat().st_mode & 0o777 == 0o600
        assert first.stop() == 0
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "locked"
        second = start_daemon(runtime_dir, "--pool-mb", "8")  # raised DaemonStartError while held
        assert second.stop() == 0
    finally:
        holder.kill()
        holder.wait()
