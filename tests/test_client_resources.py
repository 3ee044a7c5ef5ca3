"""A producer short of fds, a daemon SIGKILLed under its clients, a feature too large to go inline: put
returns (inline, counted) or raises a typed error, at once, and never kills or hangs its process."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mmfeat.client import Client
from mmfeat.protos import DaemonUnavailableError, ErrorCode, MmfeatError

from . import fd_workers


def _put_short_of_fds(children, runtime_dir: Path, free: int, connect_first: bool) -> dict:
    receive, send = children.Pipe(duplex=False)
    p = children.Process(target=fd_workers.put_with_free_fds, args=(str(runtime_dir), free, connect_first, send))
    p.start()
    send.close()
    result = None
    try:
        try:
            result = receive.recv() if receive.poll(60) else None
        except EOFError:
            pass  # it died before sending: its exit code says how
        p.join(30)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        receive.close()
    assert p.exitcode == 0, f"with {free} fds free the producer died (exit code {p.exitcode}; negative: a signal)"
    assert result is not None, f"with {free} fds free the producer sent nothing"
    return result


# 0-10 free killed or broke the producer; up to 20 also covers the steps after the control socket's
# (the session's), where the free count runs out next.
@pytest.mark.parametrize("free", range(21))
def test_a_producer_short_of_fds_falls_back_inline_and_lives(daemon, children, free: int) -> None:
    result = _put_short_of_fds(children, daemon.runtime_dir, free, connect_first=False)
    if "error" in result:  # allowed: a typed error; say which in a failure
        assert result["error"] in ("FdLimitError", "MmfeatError", "DaemonUnavailableError"), result
    else:
        assert result["intact"], result
        assert not result["inline"] or result["fallbacks"] == {"fd_limit": 1}, result
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the producer's feature and arena to go back")


def test_fd_limit_fallbacks_are_what_a_starved_producer_gets(daemon, children) -> None:
    """With no fd to spare the put goes inline, counted as fd_limit; with plenty it uses the pool; a
    producer that connected first needs no new fd to put."""
    starved = _put_short_of_fds(children, daemon.runtime_dir, 0, connect_first=False)
    assert starved == {"inline": True, "fallbacks": {"fd_limit": 1}, "intact": True}
    roomy = _put_short_of_fds(children, daemon.runtime_dir, 64, connect_first=False)
    assert roomy == {"inline": False, "fallbacks": {}, "intact": True}
    connected = _put_short_of_fds(children, daemon.runtime_dir, 0, connect_first=True)
    assert connected == {"inline": False, "fallbacks": {}, "intact": True}


def _killed(daemon_factory) -> tuple[Path, int]:
    d = daemon_factory("--pool-mb", "16")
    d.proc.kill()
    d.proc.wait()
    assert (d.runtime_dir / "mmfeatd.sock").exists(), "the SIGKILLed daemon's socket files stay behind"
    return d.runtime_dir, d.pid


def test_a_killed_daemons_leftover_sockets_are_known_at_once(daemon_factory) -> None:
    runtime_dir, pid = _killed(daemon_factory)
    gone = f"no daemon holds {runtime_dir} (pid {pid} is gone)"
    t = torch.ones(1 << 18)
    # A 30 s timeout: returning in a fraction of it shows the put did not wait for an answer.
    with Client(runtime_dir, timeout=30.0, inline_threshold=0, fallback="error") as c:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match=gone.replace("(", r"\(").replace(")", r"\)")):
            c.put(t)
        assert time.monotonic() - t0 < 10
    with Client(runtime_dir, timeout=30.0, inline_threshold=0) as c:
        t0 = time.monotonic()
        assert c.put(t).is_inline and c.fallbacks == {"unreachable": 1}
        assert time.monotonic() - t0 < 10
    # The CLI's start is timed too, which a busy machine makes seconds long: a timeout of 600 s, which a
    # probe that waited would run out, far beyond any start.
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mmfeat.cli", "--runtime-dir", str(runtime_dir), "--timeout", "600",
                        "health"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 1 and gone in r.stderr, r.stderr
    assert time.monotonic() - t0 < 300


def test_a_daemon_killed_under_a_connected_client_is_known_at_once(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "16")
    with Client(d.runtime_dir, timeout=30.0) as c:
        c.ping()
        d.proc.kill()
        d.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match=f"pid {d.pid} is gone"):
            c.stats()
        assert time.monotonic() - t0 < 10


def test_a_client_that_cannot_read_the_lock_asks_the_control_socket(daemon_factory) -> None:
    """As a client of another user does, whom the daemon's 0600 lock file does not let in."""
    runtime_dir, _ = _killed(daemon_factory)
    (runtime_dir / "mmfeatd.lock").unlink()
    with Client(runtime_dir, timeout=30.0, inline_threshold=0, fallback="error") as c:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="its control socket refuses connections"):
            c.put(torch.ones(1 << 18))
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("planted", ["directory", "fifo"])
def test_a_lock_path_that_is_no_file_leaves_the_answer_to_the_socket(tmp_path, planted) -> None:
    """A runtime dir someone else made (a squatted /tmp/mmfeat-<uid>) may hold anything at the lock's
    path: the probe gives no verdict on what is not a regular file, and the client gets the typed error
    (or the inline fallback) instead of an OSError from reading it."""
    runtime_dir = tmp_path / "rt"
    runtime_dir.mkdir()
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(runtime_dir / "mmfeatd.sock"))  # a socket file nobody listens on
    dead.close()
    lock = runtime_dir / "mmfeatd.lock"
    lock.mkdir() if planted == "directory" else os.mkfifo(lock)
    with Client(runtime_dir, timeout=30.0, inline_threshold=0) as c:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="its control socket refuses connections"):
            c.ping()
        assert c.put(torch.ones(1 << 18)).is_inline and c.fallbacks == {"unreachable": 1}
        assert time.monotonic() - t0 < 10

def test_a_live_daemon_is_not_mistaken_for_a_dead_one(daemon) -> None:
    """The probe's connection to the control socket, and its shared lock, leave a live daemon serving."""
    from mmfeat.client.link.daemon_lock import gone_daemon

    assert gone_daemon(daemon.runtime_dir) is None
    os.rename(daemon.runtime_dir / "mmfeatd.lock", daemon.runtime_dir / "lock.aside")
    try:
        assert gone_daemon(daemon.runtime_dir) is None
    finally:
        os.rename(daemon.runtime_dir / "lock.aside", daemon.runtime_dir / "mmfeatd.lock")
    with daemon.client(inline_threshold=0) as c:
        desc = c.put(torch.ones(1 << 18))
        assert not desc.is_inline and c.get(desc).sum().item() == 1 << 18
        c.ack(desc)


def test_a_daemon_starts_through_a_clients_momentary_probe_of_its_lock(daemon_factory) -> None:
    runtime_dir_of_dead, _ = _killed(daemon_factory)
    fd = os.open(runtime_dir_of_dead / "mmfeatd.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # what a client's probe holds, for a moment
    from mmfeat.daemon.sockets.runtime_dir import RuntimeDir

    rd = RuntimeDir(runtime_dir_of_dead)
    threading.Timer(0.05, fcntl.flock, (fd, fcntl.LOCK_UN)).start()
    try:
        rd.acquire()
    finally:
        rd.release()
        os.close(fd)


_PROBES = """
import sys
from pathlib import Path
from mmfeat.client.link.daemon_lock import gone_daemon
rd = Path(sys.argv[1])
print("probing", flush=True)
while True:
    gone_daemon(rd, ask_socket=False)
"""


def test_a_daemon_starts_at_its_first_try_while_clients_probe_its_lock(daemon_factory, monkeypatch) -> None:
    """The probe takes nothing: a daemon starting while two processes probe the dir without pause gets its
    lock at once, every time, with no grace to retry in."""
    from mmfeat.daemon.sockets import runtime_dir as rdm

    runtime_dir, _ = _killed(daemon_factory)
    monkeypatch.setattr(rdm, "_PROBE_GRACE_S", 0.0)
    probes = [subprocess.Popen([sys.executable, "-c", _PROBES, str(runtime_dir)], stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    try:
        assert all(p.stdout.readline().strip() == "probing" for p in probes)
        for attempt in range(300):
            rd = rdm.RuntimeDir(runtime_dir)
            try:
                rd.acquire()
            except rdm.RuntimeDirError as exc:
                pytest.fail(f"start {attempt} met a probe's lock: {exc}")
            finally:
                rd.release()
        assert all(p.poll() is None for p in probes), "a probe failed"
    finally:
        for p in probes:
            p.kill()
            p.wait()


def test_a_lock_file_of_an_earlier_release_is_probed_with_its_flock(tmp_path) -> None:
    """A daemon of an earlier release holds a flock alone, which the OFD query does not see, and writes
    its pid alone: the probe then asks the flock, as that release's clients did."""
    from mmfeat.client.link.daemon_lock import gone_daemon

    lock = tmp_path / "mmfeatd.lock"
    lock.write_text("4242\n")
    os.chmod(lock, 0o600)
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert gone_daemon(tmp_path, ask_socket=False) is None  # held: a daemon serves the dir
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert "pid 4242 is gone" in gone_daemon(tmp_path, ask_socket=False)
    finally:
        os.close(fd)


def test_a_daemon_holds_a_lock_of_each_kind(daemon) -> None:
    """The OFD lock for this release's probes, and a flock for an earlier release's clients and daemons."""
    from mmfeat.protos import lock_file

    fd = os.open(daemon.runtime_dir / "mmfeatd.lock", os.O_RDONLY)
    try:
        assert lock_file.held(fd)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_feature_over_inline_max_raises_instead_of_going_inline(daemon_factory, tmp_path) -> None:
    assert Client(tmp_path).inline_max == 256 << 20
    big, small = torch.ones(1 << 19), torch.ones(1 << 17)  # 2 MiB and 512 KiB
    with Client(tmp_path, timeout=0.5, inline_threshold=0, inline_max=1 << 20) as c:  # no daemon at all
        with pytest.raises(MmfeatError) as info:
            c.put(big)
        assert info.value.code is ErrorCode.TOO_LARGE and "inline_max" in info.value.message
        assert "unreachable" in info.value.message
        assert c.put(small).is_inline and c.fallbacks == {"unreachable": 1}
    d = daemon_factory("--pool-mb", "1")  # refuses a 2 MiB feature: larger than its pool
    with d.client(inline_threshold=0, inline_max=1 << 20) as c:
        with pytest.raises(MmfeatError) as info:
            c.put(big)
        assert info.value.code is ErrorCode.TOO_LARGE and "inline_max" in info.value.message
        assert "MMFEAT_INLINE_MAX" in info.value.message and c.fallbacks == {}
    assert d.pool()["used"] == 0


def test_inline_max_is_validated(tmp_path) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="inline_max"):
            Client(tmp_path, inline_max=bad)


def test_inline_max_comes_from_the_environment(tmp_path) -> None:
    code = f"from mmfeat.client import Client; print(Client({str(tmp_path)!r}).inline_max)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MMFEAT_INLINE_MAX": str(3 << 20)})
    assert r.returncode == 0 and r.stdout.strip() == str(3 << 20), r.stderr[-2000:]
