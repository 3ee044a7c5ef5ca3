"""Keyed features and the retained lifetime (SPEC.md, section 3, "Keys and lifetimes"), against a real
daemon, with producers, holders and readers in processes of their own where it matters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from mmfeat.client import MAX_KEY_BYTES, MAX_LOOKUP_KEYS, Client, ErrorCode, MmfeatError, Namespace

from . import key_workers
from .conftest import start_daemon
from .ttls import put_and_hold, sleep_until

NS = Namespace(framework="vllm", version="0.32.0", model="Qwen/Qwen2-VL", dtype="bfloat16")
MIB = 1 << 20


def books_balance(d) -> dict:
    """Nothing live: no lease, no hold, no key, no byte of the pool (an arena is given back once idle)."""
    s = d.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0} and s["holds"] == 0
                   and all(n["keys"] == 0 and n["bytes_retained"] == 0 for n in s["namespaces"].values()),
                   timeout=30, what="the books to balance")
    pool = s["pools"][0]
    assert pool["used"] == pool["arenas"]["bytes"] and pool["arenas"]["live_bytes"] == 0
    return s


def test_namespace_ids_and_keys() -> None:
    assert len(NS.id) == 16 and int(NS.id, 16) >= 0
    assert NS.id == Namespace("vllm", "0.32.0", "Qwen/Qwen2-VL", "bfloat16", "").id
    other = Namespace("vllm", "0.32.0", "Qwen/Qwen2-VL", "float16")
    assert other.id != NS.id
    assert NS.key("abc") == f"{NS.id}/abc"


def produced(daemon, children, keys: list[str]) -> list[bytes]:
    """key_workers.keyed_producer's descriptors of ``keys`` (retained, 300 s), put by a process that exited."""
    q = children.Queue()
    p = children.Process(target=key_workers.keyed_producer, args=(str(daemon.runtime_dir), keys, 300.0, q))
    p.start()
    descs = q.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    return descs


def test_keyed_put_lookup_has_many_get_by_key(daemon, children) -> None:
    keys = [NS.key(f"img{i}") for i in range(3)]
    descs = produced(daemon, children, keys)
    with daemon.client() as c:
        missing = NS.key("never")
        assert c.has_many([*keys, missing]) == [True, True, True, False]
        assert c.has(keys[1]) and not c.has(missing)
        assert c.lookup(missing) is None
        assert c.lookup(keys[2]).to_bytes() == descs[2]
        # The producer exited: retained features stay readable, by key, as often as anyone reads them.
        for _ in range(3):
            assert torch.equal(c.get(key=keys[2], copy=True), torch.full((4096,), 2.0))
        with pytest.raises(MmfeatError) as e:
            c.get(key=missing)
        assert e.value.code is ErrorCode.NOT_FOUND
        assert all(c.evict(k) for k in keys)
    books_balance(daemon)


def test_put_under_a_live_key_returns_the_live_feature(daemon) -> None:
    key, counted = NS.key("same"), NS.key("counted")
    with daemon.client() as c:
        first = c.put(torch.ones(10000), key=key, retain_ttl=300.0)
        again = c.put(torch.zeros(10000), key=key, retain_ttl=300.0)
        assert again.to_bytes() == first.to_bytes()
        r = c.reserve((10000,), torch.float32, key=key, retain_ttl=300.0)
        r.fill_(5)
        assert c.publish(r).to_bytes() == first.to_bytes()
        assert torch.equal(c.get(key=key, copy=True), torch.ones(10000))
        # Counted and keyed: today's rules, found by key while live. A second counted put under the
        # key is a feature of its own (its consumers are counted on it), found by no key.
        d1 = c.put(torch.ones(10000), key=counted, consumers=2)
        d2 = c.put(torch.zeros(10000), key=counted, consumers=2)
        assert d2.to_bytes() != d1.to_bytes() and c.lookup(counted).to_bytes() == d1.to_bytes()
        c.ack(d1, count=2)
        c.flush()
        assert not c.has(counted)
        assert torch.equal(c.get(d2, copy=True), torch.zeros(10000))
        c.ack(d2, count=2)
        s = daemon.stats()
        # The retained puts and the reserve were answered with the live feature; the counted put was not.
        assert s["counters"]["dedups"] == 3 and s["namespaces"][NS.id]["dedups"] == 3
        assert c.evict(key)
    books_balance(daemon)


def test_two_namespaces_never_alias(daemon) -> None:
    a, b = NS, Namespace("vllm", "0.32.0", "llava-hf/llava-1.5-7b-hf", "bfloat16")
    with daemon.client() as c:
        c.put(torch.ones(10000), key=a.key("h"), retain_ttl=300.0)
        assert not c.has(b.key("h"))
        c.put(torch.full((10000,), 2.0), key=b.key("h"), retain_ttl=300.0)
        assert torch.equal(c.get(key=a.key("h"), copy=True), torch.ones(10000))
        assert torch.equal(c.get(key=b.key("h"), copy=True), torch.full((10000,), 2.0))
        ns = c.stats()["namespaces"]
        assert ns[a.id]["keys"] == 1 and ns[b.id]["keys"] == 1
        assert c.evict(a.key("h")) and c.evict(b.key("h"))
    books_balance(daemon)


def test_a_restart_forgets_every_key(runtime_dir) -> None:
    d = start_daemon(runtime_dir, "--pool-mb", "16")
    key = NS.key("before")
    try:
        with Client(runtime_dir) as c:
            old = c.put(torch.ones(10000), key=key, retain_ttl=300.0)
        assert d.stop() == 0
        d.proc.communicate()
        d = start_daemon(runtime_dir, "--pool-mb", "16")
        with Client(runtime_dir) as c:
            assert c.has_many([key]) == [False] and c.lookup(key) is None and c.hold(key) is None
            assert c.hold(old) is None  # its descriptor names the old epoch
            fresh = c.put(torch.zeros(10000), key=key, retain_ttl=300.0)
            assert fresh.epoch != old.epoch
            assert c.evict(key)
    finally:
        d.stop()
        d.proc.communicate()


def test_retained_read_by_many_then_freed_after_ttl_unheld(daemon) -> None:
    key = NS.key("ttl")
    with daemon.client() as c:
        desc = c.put(torch.ones(10000), key=key, retain_ttl=1.0)
        for _ in range(5):
            assert torch.equal(c.get(desc, copy=True), torch.ones(10000))
            c.ack(desc)  # an ack of the feature itself counts nothing: it stays
        c.flush()
        assert c.has(key)
    s = books_balance(daemon)
    assert s["counters"]["retained_expired"] == 1 and s["counters"]["retained_acks"] == 5
    assert s["counters"]["expired"] == 0 and s["namespaces"][NS.id]["expired"] == 1


def test_held_feature_outlives_its_ttl_until_its_readers_ack(daemon, children) -> None:
    with daemon.client() as producer, daemon.client(map_pools=False) as scheduler:
        scheduler.connect()  # before the TTL's clock starts: the hold is one request after the put
        held = put_and_hold(lambda k, ttl: producer.put(torch.ones(4096), key=k, retain_ttl=ttl),
                            lambda k: scheduler.hold(k, count=2), lambda n: NS.key(f"held{n}"), 0.5)
        producer.close()  # gone, as an encoder that exits: the retained feature is the daemon's now
        key, hold = held.key, held.hold
        # Past the TTL: the hold keeps it, and its key still finds it.
        daemon.wait_for(lambda s: s["uptime_s"] > 0 and s["holds"] == 1, what="the hold")
        sleep_until(held.ran_out_by)
        assert scheduler.has(key)
        q = children.Queue()
        readers = [children.Process(target=key_workers.reader, args=(str(daemon.runtime_dir), hold.to_bytes(), q))
                   for _ in range(2)]
        for r in readers:
            r.start()
        assert [q.get(timeout=60), q.get(timeout=60)] == [4096.0, 4096.0]
        for r in readers:
            r.join(30)
        # The second ack ended the hold; the TTL had passed, so the feature went with it.
        s = books_balance(daemon)
        assert s["counters"]["holds_ended"] == 1 and s["counters"]["retained_expired"] == 1 + held.lost
        assert not scheduler.has(key)


def test_a_dead_holders_holds_end_with_its_session(daemon, children) -> None:
    keys, q = children.Queue(), children.Queue()
    p = children.Process(target=key_workers.ready_holder, args=(str(daemon.runtime_dir), keys, 4, q))
    p.start()
    try:
        assert q.get(timeout=60) == "ready"  # started and connected before the TTL's clock starts

        def hold(key: str):
            keys.put(key)
            return q.get(timeout=60)

        with daemon.client() as producer:
            held = put_and_hold(lambda k, ttl: producer.put(torch.ones(4096), key=k, retain_ttl=ttl), hold,
                                lambda n: NS.key(f"orphan{n}"), 0.5)
        assert daemon.stats()["holds"] == 1
        sleep_until(held.ran_out_by)  # only the hold keeps the feature now
        os.kill(p.pid, signal.SIGKILL)
        s = books_balance(daemon)  # ack_ttl is 300 s by default: within seconds, the session's end did it
        assert s["counters"]["holds_reclaimed"] == 1 and s["counters"]["holds_expired"] == 0
        assert s["counters"]["retained_expired"] == 1 + held.lost
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()


def test_pressure_evicts_the_oldest_unheld_before_inline_and_never_a_held_one(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "16")
    k = [NS.key(f"p{i}") for i in range(6)]
    with d.client() as c:
        for i in range(3):
            c.put(torch.full((5 * MIB // 4,), float(i)), key=k[i], retain_ttl=300.0)
        hold = c.hold(k[0], count=1)  # the oldest, held
        fourth = c.put(torch.full((5 * MIB // 4,), 3.0), key=k[3], retain_ttl=300.0)
        assert not fourth.is_inline and c.has_many(k[:4]) == [True, False, True, True]
        c.put(torch.full((5 * MIB // 4,), 4.0), key=k[4], retain_ttl=300.0)
        assert c.has_many(k[:5]) == [True, False, False, True, True]
        c.put(torch.full((5 * MIB // 4,), 5.0), key=k[5], retain_ttl=300.0)
        assert c.has_many(k) == [True, False, False, False, True, True]
        assert torch.equal(c.get(hold, copy=True), torch.zeros(5 * MIB // 4))
        s = c.stats()
        assert s["counters"]["evictions"] == 3 and s["namespaces"][NS.id]["evictions"] == 3
        assert s["counters"]["fallbacks"] == {}
        # An unkeyed counted put makes room the same way: both unheld ones go, the held one stays.
        big = c.put(torch.ones(9 * MIB // 4))
        assert not big.is_inline and c.has_many([k[0], k[4], k[5]]) == [True, False, False]
        # Now only the held feature and a counted one are left: nothing may go, so a put goes inline.
        assert c.put(torch.ones(9 * MIB // 4)).is_inline and c.fallbacks["pool_full"] == 1
        assert torch.equal(c.get(hold, copy=True), torch.zeros(5 * MIB // 4))
        c.ack(hold)
        c.ack(big)
        assert c.evict(k[0])
    books_balance(d)


def test_evict_by_key_and_a_held_feature_goes_when_its_hold_ends(daemon) -> None:
    key = NS.key("ev")
    with daemon.client() as c:
        c.put(torch.ones(10000), key=key, retain_ttl=300.0)
        hold = c.hold(key, count=1)
        reply = c.request("evict", key=key)
        assert (reply["evicted"], reply["held"]) == (True, True)
        assert not c.has(key) and c.hold(key) is None and not c.evict(key)
        assert torch.equal(c.get(hold, copy=True), torch.ones(10000))  # the hold still reads it
        c.ack(hold)
        s = books_balance(daemon)
        assert s["counters"]["evicted_by_key"] == 1


_MAPS = """
import os, sys, torch
from mmfeat.client import Client, ErrorCode, MmfeatError
c = Client(sys.argv[1], map_pools={map_pools})
c.connect()
maps = open("/proc/self/maps").read()
print("pool" if "mmfeat-pool" in maps else "nopool", len(os.listdir("/proc/self/fd")))
for call in (lambda: c.ack(c.put(torch.ones(100000))), lambda: c.reserve((10,), torch.float32),
             lambda: c.get(bytes.fromhex(sys.argv[2]))):
    try:
        call()
        print("ok")
    except MmfeatError as exc:
        print(exc.code.value)
print(c.has(sys.argv[3]), c.hold(sys.argv[3], count=1) is not None)
c.flush()
"""


def test_a_control_only_client_maps_no_pool_and_refuses_puts_and_gets(daemon) -> None:
    key = NS.key("ctl")
    with daemon.client() as c:
        desc = c.put(torch.ones(100000), key=key, retain_ttl=300.0)
        out = {}
        for map_pools in (True, False):
            run = subprocess.run([sys.executable, "-c", _MAPS.format(map_pools=map_pools), str(daemon.runtime_dir),
                                  desc.to_bytes().hex(), key], capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr
            out[map_pools] = run.stdout.split("\n")
        assert out[True][0].startswith("pool") and out[True][1:4] == ["ok", "ok", "ok"]
        assert out[False][0].startswith("nopool") and out[False][1:4] == ["FORBIDDEN"] * 3
        assert int(out[False][0].split()[1]) < int(out[True][0].split()[1])
        assert out[False][4] == "True True"
        assert c.evict(key)
    books_balance(daemon)  # the control-only holder exited: its hold ended with it


def test_stats_per_namespace(daemon) -> None:
    key = NS.key("s")
    with daemon.client() as c:
        c.put(torch.ones(10000), key=key, retain_ttl=300.0)
        c.has_many([key, NS.key("x"), NS.key("y")])
        h = c.hold(key, count=1)
        s = c.stats()
        ns = s["namespaces"][NS.id]
        assert (ns["hits"], ns["misses"], ns["holds"], ns["keys"], ns["evictions"]) == (2, 2, 1, 1, 0)
        assert ns["bytes_retained"] == s["pools"][0]["bytes"]["PUBLISHED"] > 40000
        assert s["holds"] == 1
        c.ack(h)
        assert c.evict(key)
        assert c.stats()["namespaces"][NS.id]["evictions"] == 1
    shown = subprocess.run([sys.executable, "-m", "mmfeat.cli", "--runtime-dir", str(daemon.runtime_dir), "stats"],
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if line.startswith(NS.id))
    assert row.split()[1:2] == ["0"] and row.split()[3:8] == ["2", "2", "1", "1", "0"]


def test_bad_keys_get_typed_errors(daemon) -> None:
    with daemon.client() as c:
        bad = [12, "no-namespace", "ABCDEF0123456789/upper", f"{NS.id}/", f"{NS.id}/" + "x" * MAX_KEY_BYTES]
        for key in bad:
            for call in (c.has, c.lookup, c.evict, lambda k: c.put(torch.ones(10000), key=k, retain_ttl=1.0)):
                with pytest.raises(MmfeatError) as e:
                    call(key)
                assert e.value.code is ErrorCode.BAD_REQUEST, (key, e.value)
            # The daemon checks them as strictly, whatever a client sends.
            with pytest.raises(MmfeatError) as e:
                c.request("lookup_key", keys=[key])
            assert e.value.code is ErrorCode.BAD_REQUEST
        too_many = [NS.key(str(i)) for i in range(MAX_LOOKUP_KEYS + 1)]
        for call in (c.has_many, lambda ks: c.request("lookup_key", keys=ks)):
            with pytest.raises(MmfeatError) as e:
                call(too_many)
            assert e.value.code is ErrorCode.TOO_LARGE and "split" in e.value.message
        assert len(c.has_many(too_many[:MAX_LOOKUP_KEYS])) == MAX_LOOKUP_KEYS
        with pytest.raises(MmfeatError) as e:
            c.request("evict", key=NS.key("x") + "é" * 200)
        assert e.value.code is ErrorCode.BAD_REQUEST and "bytes" in e.value.message
        # A keyed publish must carry the descriptor of exactly its lease.
        s = c.session
        r = c.request("reserve", session=s.token, nbytes=100000, key=NS.key("raw"), retain_ttl=5.0)
        for descriptor in (None, b"\x93junk"):
            with pytest.raises(MmfeatError) as e:
                c.request("publish", session=s.token, lease=r["lease"], descriptor=descriptor)
            assert e.value.code is ErrorCode.BAD_REQUEST
        c.request("release", session=s.token, lease=r["lease"])
        # Holds are for retained features.
        counted = c.put(torch.ones(100000), key=NS.key("counted"))
        with pytest.raises(MmfeatError) as e:
            c.hold(NS.key("counted"))
        assert e.value.code is ErrorCode.BAD_STATE
        c.ack(counted)
    books_balance(daemon)


def test_namespace_metrics_for_prometheus(daemon_factory) -> None:
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory("--pool-mb", "16", "--metrics-port", str(port))
    key = NS.key("m")
    with d.client() as c:
        c.put(torch.ones(100000), key=key, retain_ttl=300.0)
        h = c.hold(key)
        want = (f'mmfeat_namespace_holds_total{{namespace="{NS.id}"}} 1.0',
                f'mmfeat_namespace_keys{{namespace="{NS.id}"}} 1.0', "mmfeat_holds_live 1.0")
        deadline = time.monotonic() + 30  # the loop refreshes the metrics snapshot every second at most
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            if all(line in text for line in want) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert all(line in text for line in want), text
        c.ack(h)
        assert c.evict(key)


def test_hold_many_looks_up_and_holds_in_one_request_all_or_none(daemon_factory) -> None:
    """hold_keys: a retained key's answer is a hold of its own, a counted key's its own descriptor (no
    hold), a key evicted or never put a miss; a refused hold gives back the ones the request took."""
    d = daemon_factory("--pool-mb", "16", "--max-session-leases", "2")
    ret, counted, gone = [NS.key("hk0"), NS.key("hk1")], NS.key("hk-counted"), NS.key("hk-gone")
    for i, k in enumerate([*ret, gone, counted]):  # a session each: max_session_leases caps what one holds
        with d.client() as producer:
            if k == counted:
                own = producer.put(torch.ones(10000), key=counted)
            else:
                producer.put(torch.full((10000,), float(i)), key=k, retain_ttl=300.0)
    with d.client() as evictor:
        assert evictor.evict(gone)
    holder = d.client(map_pools=False)
    try:
        before = d.stats()["counters"]
        found = holder.hold_many([ret[0], counted, gone, NS.key("never"), ret[1]], count=2)
        s = d.stats()
        assert s["counters"]["requests_by_op"]["hold_keys"] - before["requests_by_op"].get("hold_keys", 0) == 1
        assert [f is not None and f[1] for f in found] == [True, False, False, False, True]
        assert found[2] is None and found[3] is None and found[1][0].to_bytes() == own.to_bytes()
        assert s["holds"] == 2 and s["namespaces"][NS.id]["hits"] == 3 and s["namespaces"][NS.id]["misses"] == 2
        with d.client() as reader:  # a hold reads and acks as any feature: two readers' acks end it
            for i in (0, 4):
                assert torch.equal(reader.get(found[i][0], copy=True), torch.full((10000,), float(i // 4)))
                reader.ack(found[i][0], count=2)  # in the lease table: the holds end at the next sweep
            # Those acks give the holder's quota back, swept or not yet.
            again = holder.hold_many(ret)
            assert [f[1] for f in again] == [True, True]
            for f in again:
                reader.ack(f[0])
        d.wait_for(lambda s: s["holds"] == 0, timeout=15, what="the holds ended by their readers' acks")
        # Past max_session_leases on the third hold: the request fails whole, the first two go back.
        with pytest.raises(MmfeatError) as e:
            holder.hold_many([ret[0], ret[1], ret[0]])
        assert e.value.code is ErrorCode.OVER_QUOTA
        s = d.stats()
        assert s["holds"] == 0 and s["counters"]["holds_ended"] == s["counters"]["holds"] == 6
        # Refused keys, lists and counts, by the client before sending and by the daemon whatever it is sent.
        too_many = [NS.key(str(i)) for i in range(MAX_LOOKUP_KEYS + 1)]
        for keys, code in ((["no-namespace"], ErrorCode.BAD_REQUEST), ([], ErrorCode.BAD_REQUEST),
                           (too_many, ErrorCode.TOO_LARGE)):
            if keys:
                with pytest.raises(MmfeatError) as e:
                    holder.hold_many(keys)
                assert e.value.code is code
            with pytest.raises(MmfeatError) as e:
                holder.request("hold_keys", session=holder.session.token, keys=keys)
            assert e.value.code is code, keys
        for bad in ({"count": 0}, {"count": 4097}, {"timeout": 0}):
            with pytest.raises(ValueError):
                holder.hold_many([ret[0]], **bad)
        assert d.stats()["holds"] == 0
    finally:
        holder.close()
    with d.client() as c:
        c.ack(own)
        assert [c.evict(k) for k in ret] == [True, True]
    books_balance(d)


def test_hold_many_across_a_daemon_restart_misses_then_holds_on_the_new_daemon(runtime_dir) -> None:
    """A scheduler connected before a restart: its next hold_many answers misses (the keys went with the
    epoch), never an error, and the same client holds on the new daemon after."""
    key = NS.key("across-many")
    d = start_daemon(runtime_dir, "--pool-mb", "16")
    scheduler = Client(runtime_dir, map_pools=False, timeout=5.0)
    try:
        scheduler.connect()
        with Client(runtime_dir) as p:
            p.put(torch.ones(4096), key=key, retain_ttl=300.0)
        assert d.stop() == 0
        d.proc.communicate()
        d = start_daemon(runtime_dir, "--pool-mb", "16")
        assert scheduler.hold_many([key], count=2) == [None]
        with Client(runtime_dir) as p:
            p.put(torch.full((4096,), 3.0), key=key, retain_ttl=300.0)
            (found,) = scheduler.hold_many([key], count=1)
            assert found is not None and found[1] and d.stats()["holds"] == 1
            assert torch.equal(p.get(found[0], copy=True), torch.full((4096,), 3.0))
            p.ack(found[0])
            p.flush()
        assert d.stats()["holds"] == 0 and scheduler.evict(key)
        books_balance(d)
    finally:
        scheduler.close()
        d.stop()
