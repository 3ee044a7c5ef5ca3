"""No fd growth in the daemon or the client over hundreds of connect/put/get/ack cycles (success path)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import torch

from mmfeat.client import Client

from .conftest import assert_fds_settle, fd_count


def test_no_fd_growth_over_connect_put_get_ack_cycles(daemon) -> None:
    x = torch.arange(50_000, dtype=torch.float32)
    with Client(daemon.runtime_dir, inline_threshold=0) as warm:  # first mapping and ZMQ context, outside the count
        warm.ack(warm.put(x))
    daemon_before, client_before = fd_count(daemon.pid), fd_count(os.getpid())
    for i in range(300):
        with Client(daemon.runtime_dir, inline_threshold=0) as producer, Client(daemon.runtime_dir) as consumer:
            desc = producer.put(x, consumers=1)
            got = consumer.get(desc, copy=(i % 2 == 0))
            assert got[-1].item() == 49_999.0
            assert consumer.ack(desc, wait=True)["freed"]
    # The last view holds the pool's mapping, and with it the fd the mapping keeps, until it goes; the
    # warm client's was unmapped at its close, before the count.
    del got
    s = daemon.stats()
    assert s["pools"][0]["used"] == 0 and s["counters"]["frees"] == 301
    # The last clients' fd-channel EOFs may still be in flight when stats arrives on the control socket.
    daemon.wait_for(lambda s: s["sessions"] == 0, timeout=20, what="sessions to end with their clients")
    assert_fds_settle(daemon.pid, daemon_before)
    assert_fds_settle(os.getpid(), client_before)


def test_long_lived_client_reuses_one_mapping(daemon) -> None:
    with Client(daemon.runtime_dir, inline_threshold=0) as c:
        c.ack(c.put(torch.ones(1000)))
        gc.collect()  # earlier tests' pools, unmapped once collected, do not change the count below
        before = fd_count(os.getpid())
        maps_before = open("/proc/self/maps").read().count("mmfeat-pool0")
        for _ in range(200):
            descs = [c.put(torch.ones(1000 + k)) for k in range(5)]
            for d in descs:
                c.get(d)
                c.ack(d)
        assert fd_count(os.getpid()) <= before
        assert open("/proc/self/maps").read().count("mmfeat-pool0") <= maps_before
    assert daemon.pool()["used"] == 0


def test_threads_share_one_client(daemon) -> None:
    with Client(daemon.runtime_dir, inline_threshold=0) as c:

        def work(k: int) -> None:
            for i in range(40):
                t = torch.full((2000,), float(k * 1000 + i))
                d = c.put(t)
                assert torch.equal(c.get(d), t)
                c.ack(d)

        errors = _in_threads(work, 4)
    assert not errors, errors
    s = daemon.wait_for(lambda s: s["sessions"] == 0, timeout=20, what="sessions to end with their clients")
    assert s["pools"][0]["used"] == 0 and s["counters"]["frees"] == 160


def test_connect_up_front_and_without_a_daemon(daemon, tmp_path) -> None:
    import pytest

    from mmfeat.protos import DaemonUnavailableError

    with Client(daemon.runtime_dir) as c:
        c.connect()
        assert daemon.stats()["clients"] == 1
    with Client(tmp_path, timeout=0.5) as c:
        with pytest.raises(DaemonUnavailableError):
            c.connect()


def test_forked_child_uses_its_own_session_and_acker(daemon) -> None:
    import multiprocessing as mp

    with Client(daemon.runtime_dir, inline_threshold=0) as c:
        c.ack(c.put(torch.ones(1000)), wait=False)  # the parent has a session and an acker thread
        assert c.flush(5.0)
        descs = [c.put(torch.full((1000,), float(k))) for k in range(3)]

        def child() -> None:
            # Inherited: the session, the channel and an acker whose thread did not survive the fork.
            for k, d in enumerate(descs):
                assert c.get(d)[0].item() == float(k)
                assert c.ack(d, wait=False) is None
            assert c.flush(5.0)
            c.close()

        p = mp.get_context("fork").Process(target=child)
        p.start()
        p.join(30)
        assert p.exitcode == 0
        s = daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, timeout=20, what="the child's acks")
        assert s["counters"]["frees"] == 4
        c.ack(c.put(torch.ones(1000)))  # the parent's own session still works


def test_a_closed_session_ends_while_a_child_forked_from_it_lives(daemon) -> None:
    """A child forked from a producer (a worker pool made with fork) holds a copy of the session's fd
    channel whether or not it uses the Client. The parent's close() must still end the session at the
    daemon at once, not when the last such child exits; and the child's own use and close of the
    inherited Client, meanwhile, leaves the parent's session working."""
    two = torch.full((50_000,), 2.0)  # made here: torch's thread pool does not survive a fork
    c = Client(daemon.runtime_dir, inline_threshold=0, fallback="error")
    c.ack(c.put(torch.ones(50_000)))
    assert c.flush(5.0)
    pids: list[int] = []
    go = os.pipe()

    def fork(use: bool) -> int:
        pid = os.fork()
        if pid == 0:  # waits for the parent's word; then uses and closes the Client it inherited, or not
            code = 1
            try:
                os.read(go[0], 1)
                if use:
                    d = c.put(two)
                    ok = float(c.get(d)[-1]) == 2.0 and c.ack(d, wait=True)["freed"]
                    c.close()
                    code = 0 if ok else 1
                else:
                    code = 0
            finally:
                os._exit(code)
        pids.append(pid)
        return pid

    try:
        user = fork(use=True)
        c.ack(c.put(torch.ones(50_000)))  # the parent's session goes on while the child holds its copy
        assert c.flush(5.0)
        os.write(go[1], b"u")
        deadline = time.monotonic() + 60
        while (done := os.waitpid(user, os.WNOHANG)) == (0, 0):
            assert time.monotonic() < deadline, "the child's put, get, ack and close did not finish"
            time.sleep(0.05)
        pids.remove(user)
        assert done[1] == 0, "the child's put, get or ack of its own feature failed"
        c.ack(c.put(torch.ones(50_000)))
        assert c.flush(5.0)
        fork(use=False)  # never uses the Client: its copy of the session lives until the parent lets it go
        c.close()
        daemon.wait_for(lambda s: s["sessions"] == 0 and s["pools"][0]["used"] == 0, timeout=10,
                        what="the closed session to end while a child forked from it lives")
    finally:
        for pid in pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(go[0])
        os.close(go[1])


def test_a_process_with_more_than_1024_fds_open(daemon) -> None:
    """Inference servers hold thousands of fds: nothing in the client may use select()."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        import pytest

        pytest.skip(f"the hard fd limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) > 1024
        with Client(daemon.runtime_dir, inline_threshold=0, fallback="error") as c:
            for _ in range(3):
                d = c.put(torch.arange(5000))
                assert torch.equal(c.get(d), torch.arange(5000))
                c.ack(d, wait=False)
            assert c.flush(5.0)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert daemon.pool()["used"] == 0


def test_threads_waiting_on_the_fd_channel_at_once_all_get_their_replies(daemon) -> None:
    """Plain acks wait for their replies on the shared fd channel; a thread must not sleep through a
    reply another thread read for it."""
    with Client(daemon.runtime_dir, inline_threshold=0, timeout=3.0) as c:
        descs = [c.put(torch.ones(1000), consumers=1) for _ in range(8 * 25)]

        def work(k: int) -> None:
            for d in descs[k::8]:
                assert c.ack(d, wait=True)["freed"]

        errors = _in_threads(work, 8)
    assert not errors, errors[:3]
    assert daemon.pool()["used"] == 0


def _in_threads(work, n: int) -> list[BaseException]:
    """Run ``work(k)`` for k in range(n) on n threads at once; the exceptions they raised."""
    import threading

    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            work(k)
        except BaseException as exc:  # surfaced by the caller's assert
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def test_a_closed_clients_pool_and_table_are_unmapped_once_nothing_uses_them(daemon) -> None:
    """A pool stays mapped while a client of the process uses it or a tensor from get() views it, and
    not after: a process that outlives its daemon, or talks to several, would otherwise keep every pool
    it ever mapped allocated (a deleted memfd's pages live as long as a mapping of them)."""
    code = """
import gc, sys, torch
from mmfeat.client import Client

def mapped(name):
    gc.collect()
    return open("/proc/self/maps").read().count(name)

a, b = Client(sys.argv[1], inline_threshold=0), Client(sys.argv[1], inline_threshold=0)
desc = a.put(torch.arange(1000, dtype=torch.float32))
view = b.get(desc)
assert mapped("mmfeat-pool0") == 1 and mapped("mmfeat-leases") == 1, "one mapping shared by both clients"
a.close()
assert mapped("mmfeat-pool0") == 1, "b still uses the pool"
b.ack(desc)
b.close()
assert mapped("mmfeat-pool0") == 1 and float(view[999]) == 999.0, "the view still holds the pages"
del view
assert mapped("mmfeat-pool0") == 0, "no client uses the pool and no tensor views it"
assert mapped("mmfeat-leases") == 1, "a closed client keeps its table for acks from finalizers"
del a, b
assert mapped("mmfeat-leases") == 0, "nothing uses the table"
with Client(sys.argv[1], inline_threshold=0) as c:  # maps them again
    d = c.put(torch.ones(10))
    assert float(c.get(d).sum()) == 10.0
    c.ack(d)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code, str(daemon.runtime_dir)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the feature to be freed")
