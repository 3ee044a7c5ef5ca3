"""The key feed (SPEC.md, section 12): a consumer learns the keys another process binds without a round
trip, and nothing a subscriber does to the feed harms the daemon or the client."""

from __future__ import annotations

import os
import resource
import socket
import stat
import subprocess
import sys
import time
from typing import Callable, Optional

import pytest

from mmfeat.client import Client, Namespace
from mmfeat.client.link.key_feed import KeyFeed
from mmfeat.protos.descriptor import Descriptor

from .conftest import WAIT_S, assert_fds_settle, fd_count
from .forking import fork_holding, reap

NS = Namespace("feed-test", "1", "model-a", "float32")
OTHER = Namespace("feed-test", "1", "model-b", "float32")
FEED_FILE = "mmfeatd.feed.sock"

# A producer in a process of its own: it puts each key of its argv as a retained feature and prints the
# descriptor's hex, then waits for a line on stdin before it exits (so the test decides when it goes).
_PRODUCER = """
import sys, torch
from mmfeat.client import Client
with Client(sys.argv[1], inline_threshold=0, fallback="error", timeout=30.0) as c:
    for key in sys.argv[2:]:
        print(c.put(torch.arange(40000, dtype=torch.float32), key=key, retain_ttl=300).to_bytes().hex(), flush=True)
    sys.stdin.readline()
"""


class Producer:
    def __init__(self, runtime_dir, *keys: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, str(runtime_dir), *keys], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.descriptors = []
        for _ in keys:
            line = self.proc.stdout.readline().strip()
            assert line, f"the producer put nothing: {self.proc.communicate(timeout=60)[1][-3000:]}"
            self.descriptors.append(bytes.fromhex(line))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        _, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err[-3000:]


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def found(c: Client, key: str, timeout: float = WAIT_S) -> bytes:
    got: list[Optional[bytes]] = [None]

    def hit() -> bool:
        got[0] = c.feed_find(key)
        return got[0] is not None

    wait_until(hit, f"the feed to name {key}", timeout)
    assert got[0] is not None
    return got[0]


def fields(d: Descriptor) -> tuple:
    return d.lease, d.gen, d.pool, d.offset, d.nbytes


def test_a_consumer_finds_what_another_process_put_and_loses_it_on_evict(host_daemon) -> None:
    key = NS.key("image-1")
    with host_daemon.client(key_feed=NS.id + "/") as c:
        c.connect()  # the subscription is in place from here: nothing the producer binds after is missed
        assert c.session.feed_endpoint == f"ipc://{host_daemon.runtime_dir / FEED_FILE}"
        assert c.feed_find(key) is None
        producer = Producer(host_daemon.runtime_dir, key)
        try:
            desc = Descriptor.from_bytes(found(c, key))
            assert desc.to_bytes() == producer.descriptors[0]
            looked_up = c.lookup(key)
            assert looked_up is not None and fields(desc) == fields(looked_up) and desc == looked_up
            ((held, is_held),) = c.hold_many([key])
            # A hold is a lease of its own over the feature's bytes: the same pool range, its own slot.
            assert is_held and (held.pool, held.offset, held.nbytes) == (desc.pool, desc.offset, desc.nbytes)
            c.ack(held, wait=True)
            assert c.evict(key)
            wait_until(lambda: c.feed_find(key) is None, "the feed to drop the evicted key")
        finally:
            producer.stop()


def test_keys_outside_the_prefix_are_not_delivered(host_daemon) -> None:
    mine, theirs = NS.key("mine"), OTHER.key("theirs")
    with host_daemon.client(key_feed=NS.id + "/", map_pools=False) as c:
        c.connect()
        producer = Producer(host_daemon.runtime_dir, theirs, mine)
        try:
            found(c, mine)  # bound after theirs, on the same feed: what came before it has been read
            assert c.feed_find(theirs) is None and len(c.session.feed) == 1
            assert c.lookup(theirs) is not None  # it exists: the feed only kept it from this subscriber
        finally:
            producer.stop()


def test_a_client_without_key_feed_opens_no_feed(host_daemon) -> None:
    with host_daemon.client() as c:
        c.connect()
        assert c.session.feed is None and c.feed_find(NS.key("x")) is None
    with pytest.raises(TypeError):
        Client(host_daemon.runtime_dir, key_feed=b"prefix")


def test_the_feed_file_has_the_control_socket_mode_and_goes_with_the_daemon(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "8", env={"MMFEAT_SOCKET_MODE": "0600"})
    control, feed = os.lstat(d.runtime_dir / "mmfeatd.sock"), os.lstat(d.runtime_dir / FEED_FILE)
    assert stat.S_ISSOCK(feed.st_mode) and stat.S_IMODE(feed.st_mode) == stat.S_IMODE(control.st_mode) == 0o600
    assert d.stop() == 0
    assert not (d.runtime_dir / FEED_FILE).exists()


def test_a_connection_flood_on_the_feed_is_capped_and_leaves_no_fds(daemon_factory) -> None:
    nofile = 4096
    d = daemon_factory("--pool-mb", "8", nofile=nofile)
    limits = d.stats()["limits"]
    assert 0 < limits["max_feed_connections"] < limits["max_connections"]
    flood = limits["max_connections"] + 50  # past the feed's cap, and past the control socket's too
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < flood + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, flood + 1024), hard))
    baseline = fd_count(d.pid)
    path = str(d.runtime_dir / FEED_FILE)
    conns = []
    try:
        for _ in range(flood):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conns.append(s)
            s.connect(path)  # blocking: a full backlog waits for the daemon's accept instead of failing
            assert d.proc.poll() is None, "the daemon died under the feed's connection flood"
        wait_until(lambda: d.stats()["limits"]["connections_refused"] > 0, "the feed to refuse connections")
        assert fd_count(d.pid) < nofile
        with d.client() as c:
            assert c.ping()["draining"] is False  # still serving
    finally:
        for s in conns:
            s.close()
    assert d.proc.poll() is None
    assert_fds_settle(d.pid, baseline)
    d.wait_for(lambda s: s["limits"]["feed_connections"] == 0, what="the flood's feed connections to go")


def test_a_client_gives_back_its_fds_at_close(host_daemon) -> None:
    with host_daemon.client(map_pools=False) as warm:  # ZeroMQ's context and its threads: started once
        warm.connect()
    baseline = fd_count(os.getpid())
    c = host_daemon.client(key_feed=NS.id + "/", map_pools=False)
    c.connect()
    assert c.session.feed is not None and c.feed_find(NS.key("none")) is None
    c.close()
    assert_fds_settle(os.getpid(), baseline)


def test_a_forked_child_never_touches_its_parents_feed(host_daemon) -> None:
    first, second = NS.key("before-fork"), NS.key("after-fork")
    with host_daemon.client(key_feed=NS.id + "/") as c:
        c.connect()
        producer = Producer(host_daemon.runtime_dir, first)
        try:
            desc = found(c, first)
            feed = c.session.feed

            def child() -> None:
                assert feed.find(first) is None  # the parent's socket and (held) lock: left alone
                c.feed_find(first)  # its own session and feed, whatever they answer
                c.close()

            # Forked while a thread holds the feed's lock: a child that took it would wait for good.
            assert reap(fork_holding([feed._lock], child), "the child waited on its parent's feed") == 0
            assert c.feed_find(first) == desc and c.session.feed is feed
        finally:
            producer.stop()
        later = Producer(host_daemon.runtime_dir, second)
        try:
            assert found(c, second) == later.descriptors[0]
        finally:
            later.stop()


def test_a_feed_in_a_forked_child_answers_none_and_closes_nothing(host_daemon) -> None:
    import zmq

    feed = KeyFeed(zmq.Context.instance(), f"ipc://{host_daemon.runtime_dir / FEED_FILE}", NS.id + "/")
    try:
        assert feed.wait_ready(WAIT_S)

        def child() -> None:
            assert feed.find(NS.key("x")) is None and not feed.wait_ready(0.1)
            feed.close()

        assert reap(fork_holding([], child), "the child hung on its parent's feed") == 0
        assert feed.find(NS.key("x")) is None and feed.wait_ready(0)  # the parent's socket still works
    finally:
        feed.close()
