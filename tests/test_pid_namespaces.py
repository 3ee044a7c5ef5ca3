"""Clients in pods of their own: each in PID, IPC, network, UTS and mount namespaces other than the daemon's
and each other's (no hostPID, hostIPC or hostNetwork), sharing nothing with the daemon but the runtime
dir's socket files. The pool and the lease table come as fds over the fd channel, a dead client is known
by that channel's EOF and its credentials by SO_PEERCRED, which the kernel translates into the daemon's
PID namespace: no pid a client reports about itself decides anything. Needs root and unshare(1)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from .conftest import assert_fds_settle, fd_count
from .pidns_workers import tensor

REPO = Path(__file__).resolve().parent.parent
# A pod's own namespaces; --kill-child: the client dies with the unshare process that waits for it.
POD = ["unshare", "--pid", "--fork", "--mount-proc", "--ipc", "--net", "--uts", "--kill-child"]


def _pods_unavailable() -> str | None:
    try:
        r = subprocess.run([*POD, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unshare(1) cannot run here: {exc}"
    return None if r.returncode == 0 else f"this machine does not let a test make namespaces ({' '.join(POD)}): " \
                                          f"{r.stderr.strip()}"


_REASON = _pods_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


class Pod:
    """``python -m tests.pidns_workers MODE RUNTIME_DIR`` in namespaces of its own; one JSON object a line each way."""

    def __init__(self, mode: str, runtime_dir: Path, log: Path, env: dict[str, str] | None = None,
                 as_user: tuple[str, ...] = ()) -> None:
        self._log = log
        self._err = open(log, "w")
        argv = [*POD, *as_user, sys.executable, "-m", "tests.pidns_workers", mode, str(runtime_dir)]
        self.proc = subprocess.Popen(argv,
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     text=True, env={**os.environ, **(env or {})})
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def hear(self, timeout: float = 120.0) -> dict[str, Any]:
        """Its next line; a worker starting on a busy machine imports torch first, hence the long wait."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the pod said nothing in {timeout} s: {self._log.read_text()[-3000:]}") from None
        assert line is not None, f"the pod ended (rc {self.proc.wait(30)}): {self._log.read_text()[-3000:]}"
        return json.loads(line)

    def say(self, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()

    @property
    def client_pid(self) -> int:
        """The client's pid as the node (and the daemon) sees it: unshare's one child, pid 1 of its namespace."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        assert len(children) == 1, children
        return int(children[0])

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait(30)
        self._err.close()
        return rc


@pytest.fixture
def pods(tmp_path: Path) -> Iterator:
    started: list[Pod] = []

    def make(mode: str, runtime_dir: Path, env: dict[str, str] | None = None, as_user: tuple[str, ...] = ()) -> Pod:
        pod = Pod(mode, runtime_dir, tmp_path / f"pod{len(started)}-{mode}.log", env, as_user)
        started.append(pod)
        return pod

    yield make
    for pod in started:
        pod.close()


def _pidns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def test_two_pods_share_the_pool_through_the_runtime_dir_alone(daemon, pods) -> None:
    """A producer puts a feature in one pod, a consumer in another reads every byte and acks it: both are
    pid 1 of namespaces of their own, so the pid each reports in its hello is the same and names neither."""
    daemon_fds = fd_count(daemon.pid)
    producer = pods("put", daemon.runtime_dir)
    made = producer.hear()
    consumer = pods("get", daemon.runtime_dir)
    consumer.say(desc=made["desc"], seed=7)
    read = consumer.hear()
    assert read["same"] and read["freed"], read
    assert read["fds_after"] <= read["fds_before"], read
    assert made["pid"] == read["pid"] == 1
    namespaces = {made["pidns"], read["pidns"], _pidns(os.getpid()), _pidns(daemon.pid)}
    assert len(namespaces) == 3, namespaces  # the test and its daemon share one; each pod has its own
    assert _pidns(producer.client_pid) == made["pidns"] and _pidns(consumer.client_pid) == read["pidns"]
    assert consumer.proc.wait(60) == 0
    producer.say(close=True)
    assert producer.hear()["closed"]
    assert producer.proc.wait(60) == 0
    s = daemon.wait_for(lambda s: s["sessions"] == 0, timeout=20, what="both pods' sessions to end")
    assert s["clients"] == 0 and s["pools"][0]["used"] == 0 and s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, s
    assert s["counters"]["reclaimed_on_disconnect"] == 0 and s["counters"]["frees"] == 1, s["counters"]
    assert_fds_settle(daemon.pid, daemon_fds)


def test_a_killed_pods_leases_are_reclaimed_and_its_published_feature_still_read(daemon, pods) -> None:
    """SIGKILL of a client that is pid 1 of its own namespace: the daemon reclaims its reserved leases and
    takes its arena back at once (its fd channel's EOF, not a pid it could look for), and the feature it
    had published is read and acked by a client in another pod."""
    daemon_fds = fd_count(daemon.pid)
    holder = pods("hold_and_hang", daemon.runtime_dir, env={"RESERVES": "5"})
    held = holder.hear()
    s = daemon.stats()
    assert s["leases"] == {"RESERVED": 5, "PUBLISHED": 1} and s["clients"] == 1, s
    assert held["pid"] == 1 and holder.client_pid != 1
    os.kill(holder.client_pid, signal.SIGKILL)
    # reserve_ttl is 30 s: gone within the wait's 20 s proves the disconnect did it.
    s = daemon.wait_for(lambda s: s["clients"] == 0 and s["leases"]["RESERVED"] == 0, timeout=20,
                        what="the killed pod's leases to be reclaimed")
    assert s["counters"]["reclaimed_on_disconnect"] == 5 and s["counters"]["expired"] == 0, s["counters"]
    assert s["leases"]["PUBLISHED"] == 1
    consumer = pods("get", daemon.runtime_dir)
    consumer.say(desc=held["desc"], seed=11)
    read = consumer.hear()
    # pid 1 of a namespace of its own; not compared with the holder's, whose inode number may come again.
    assert read["same"] and read["freed"] and read["pid"] == 1, read
    assert consumer.proc.wait(60) == 0
    s = daemon.wait_for(lambda s: s["sessions"] == 0 and s["pools"][0]["used"] == 0, timeout=20,
                        what="the pool to be empty")
    assert s["counters"]["arenas_freed"] == s["counters"]["arenas_granted"] >= 1, s["counters"]
    assert_fds_settle(daemon.pid, daemon_fds)


def test_a_pod_allowed_by_a_supplementary_group_alone_gets_the_pool(daemon_factory, pods) -> None:
    """A worker pod of its own uid and primary gid, in the allowed group only through supplementalGroups
    (deploy/kubernetes/README.md): the daemon reads its groups from its fd channel (SO_PEERGROUPS), not from
    /proc/<pid>, which names another process or none from outside the pod's PID namespace."""
    uid, group = 54321, 4242
    as_pod = ("setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={group}")
    probe = subprocess.run([*as_pod, sys.executable, "-c", "import mmfeat.client"], capture_output=True, timeout=120)
    if probe.returncode:
        pytest.skip(f"uid {uid} may not run this checkout's interpreter: {probe.stderr.decode()[-300:]}")
    d = daemon_factory("--pool-mb", "16", env={"MMFEAT_ALLOWED_GIDS": str(group), "MMFEAT_SOCKET_MODE": "0666"})
    os.chmod(d.runtime_dir, 0o755)  # the dir the worker mounts: the fd channel's check is the one under test
    with d.client(inline_threshold=0) as producer:
        desc = producer.put(tensor(5), consumers=1)
        consumer = pods("get", d.runtime_dir, as_user=as_pod)
        consumer.say(desc=desc.to_bytes().hex(), seed=5)
        read = consumer.hear()
        assert read["same"] and read["freed"] and read["pid"] == 1, read
    assert consumer.proc.wait(60) == 0
    d.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["sessions"] == 0, what="the feature to be freed")


def test_a_cut_session_is_logged_with_the_pid_the_node_knows(daemon_factory, pods) -> None:
    """The daemon names a session it cuts by the pid the kernel gave its fd channel, translated into the
    daemon's namespace, so an operator on the node finds the process: the pid a client says it has is its
    own namespace's (1 in a pod), or anything at all from a hostile one."""
    d = daemon_factory("--pool-mb", "64", "--max-refused-words", "50")
    pod = pods("refused_words", d.runtime_dir)
    said = pod.hear()
    assert said["cut"] and said["pid"] == 1, said
    node_pid = pod.client_pid
    pod.close()
    assert d.stop() == 0
    err = d.proc.communicate()[1]
    assert f"cut 'refuses' (pid {node_pid})" in err, err[-2000:]
