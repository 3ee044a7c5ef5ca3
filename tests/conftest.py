"""Fixtures: a real mmfeatd subprocess on a private runtime dir, stopped and checked after each test."""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.forkserver
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from mmfeat.client import Client
from mmfeat.testing import spawn_daemon, worker_context

from .netns import netns_pair, netns_trio  # noqa: F401  (fixtures: the cluster fixture asks for them by name)


def anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def assert_fds_settle(pid: int, baseline: int, timeout: float = 20.0) -> None:
    """ZeroMQ closes a departed peer's socket on its I/O thread, a moment later: wait for that, then
    require no growth over ``baseline``."""
    deadline = time.monotonic() + timeout
    while fd_count(pid) > baseline:
        if time.monotonic() > deadline:
            fds = sorted(os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd"))
            raise AssertionError(f"pid {pid} holds {len(fds)} fds, {baseline} before: {fds}")
        time.sleep(0.05)


def fan_out(q_prod, q_cons: list) -> None:
    """Hand each item the producer puts on ``q_prod`` to every consumer's queue, as a server's scheduler
    fans a request out to its ranks, until the producer's None, which every consumer then gets too."""
    while (item := q_prod.get(timeout=90)) is not None:
        for q in q_cons:
            q.put(item)
    for q in q_cons:
        q.put(None)


def run_ready_child(code: str, runtime_dir: Path, make_arg, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that connects first and says so, and only then make its argument.

    A child's start (torch's import) can take seconds on a loaded machine; making the feature after it
    keeps that out of a short ack_ttl. The child finds a connected ``c`` and the argument's hex in ``arg``.
    """
    prologue = ("import os, signal, sys; from mmfeat.client import Client; c = Client(sys.argv[1]); c.connect(); "
                "print('ready', flush=True); arg = bytes.fromhex(sys.stdin.readline().strip())\n")
    child = subprocess.Popen([sys.executable, "-c", prologue + code, str(runtime_dir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read() if child.poll() is not None else ""
        child.stdin.write(make_arg().hex() + "\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


# How long a test waits, by default, for what the daemon does on its own: seconds on a busy machine, but
# below the default reserve_ttl (30 s), so no TTL can meet a predicate that is waiting for another event.
WAIT_S = 20.0


@dataclass
class Daemon:
    runtime_dir: Path
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)
    logged: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, **kw) -> Client:
        # A busy machine's daemon can take seconds to answer, behind work queued before the request (a
        # peer's thousands of held acks, say): a test that needs a timeout to run out gives a short one.
        kw.setdefault("timeout", 30.0)
        return Client(self.runtime_dir, **kw)

    def stats(self) -> dict:
        with self.client() as c:
            return c.stats()

    def pool(self) -> dict:
        return self.stats()["pools"][0]

    def wait_for(self, predicate, timeout: float = WAIT_S, what: str = "condition") -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if predicate(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last stats: {s}")
            time.sleep(0.05)

    def says(self, text: str, timeout: float) -> bool:
        """Whether what the daemon logged (its stderr, a pipe) says ``text`` within ``timeout`` seconds. It
        reads the pipe itself: what it read is in ``logged``, not in a later communicate()."""
        import select

        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + timeout
        while text not in self.logged:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return False
            chunk = os.read(fd, 65536)
            if not chunk:
                return False
            self.logged += chunk.decode(errors="replace")
        return True

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_daemon(
    runtime_dir: Path, *args: str, env: dict | None = None, wait: bool = True, backend: str = "host",
    nofile: int | None = None,
    log: Path | None = None, wrap: Sequence[str] = (),
) -> Daemon:
    cmd = [*wrap, sys.executable, "-m", "mmfeat.daemon", "--runtime-dir", str(runtime_dir), "--backend", backend, *args]
    full_env = {**os.environ, **(env or {})}

    def limit_fds() -> None:  # as systemd's LimitNOFILE would
        if nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    # A long run logs to a file: a pipe nobody reads would block the daemon once full.
    err = open(log, "a") if log is not None else subprocess.PIPE
    popen = dict(env=full_env, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=limit_fds)
    if not wait:
        return Daemon(runtime_dir, subprocess.Popen(cmd, **popen), list(args))
    proc = spawn_daemon(runtime_dir, ["--backend", backend, *args], wrap=wrap, **popen)
    return Daemon(runtime_dir, proc, list(args))


def daemon_for_bad_input(what: str) -> Iterator[Daemon]:
    """One daemon, for a module's many malformed requests (the tests check it serves after each): a
    daemon apiece would cost 0.8 s each of make test. It must still exit 0 on SIGTERM after ``what``."""
    runtime = Path(tempfile.mkdtemp(prefix="mmf-", dir="/tmp"))
    d = start_daemon(runtime, "--pool-mb", "16")
    yield d
    rc = d.stop()
    _, err = d.proc.communicate()
    shutil.rmtree(runtime, ignore_errors=True)
    assert rc == 0, f"mmfeatd exited {rc} on SIGTERM after {what}: {err}"


@pytest.fixture(scope="session")
def children() -> multiprocessing.context.BaseContext:
    """The multiprocessing context for the tests' producer and consumer processes: each is forked from a
    server that imported torch and the client once, instead of spending about 2 s of CPU on those
    imports as a spawned interpreter does. They are separate processes all the same. The server starts
    here, before any test of the session has set a variable: its children inherit its environment, not
    the test's (a test that sets one for its children spawns them)."""
    ctx = worker_context()  # the bench's: the same server, the same preloads
    multiprocessing.forkserver.ensure_running()
    return ctx


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The logging stand-in for libcuda (tests/fake_cuda), built for this module; skips with the reason
    where it cannot be built (no compiler, no cuda-python)."""
    from . import fake_cuda

    path = tmp_path_factory.mktemp("fake-libcuda")
    reason = fake_cuda.build(path)
    if reason is not None:
        pytest.skip(f"fake libcuda unavailable: {reason}")
    return path


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    # Short path: AF_UNIX socket paths are limited to 107 bytes.
    d = Path(tempfile.mkdtemp(prefix="mmf-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon_factory(runtime_dir: Path) -> Iterator:
    started: list[Daemon] = []

    def make(*args: str, env: dict | None = None, nofile: int | None = None) -> Daemon:
        d = start_daemon(runtime_dir, *args, env=env, nofile=nofile)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.proc.poll() is None:
            rc = d.stop()
            out, err = d.proc.communicate()
            assert rc == 0, f"mmfeatd exited {rc} on SIGTERM: {err}"
            assert not (d.runtime_dir / "mmfeatd.sock").exists(), "control socket left behind"
            assert not (d.runtime_dir / "mmfeatd.fds.sock").exists(), "fd socket left behind"
        else:
            d.proc.communicate()


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    return daemon_factory("--pool-mb", "128")


@pytest.fixture
def host_daemon(daemon_factory) -> Daemon:
    """A small host pool (16 MiB) for the fake-driver runs, which put GPU features staged through it."""
    return daemon_factory("--pool-mb", "16")


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    """Nodes for mesh tests (tests/cluster.py); every daemon still running is stopped afterwards. Made
    indirect with the parameter "netns", each node is a network namespace of its own (tests/netns.py),
    removed after its daemons stopped; "netns3": three of them, on a bridge."""
    from .cluster import Cluster

    param = getattr(request, "param", "host")
    netns = request.getfixturevalue({"netns": "netns_pair", "netns3": "netns_trio"}[param]) if param != "host" else None
    c = Cluster(tmp_path, netns)
    yield c
    for name in list(c.daemons):
        c.stop(name)
