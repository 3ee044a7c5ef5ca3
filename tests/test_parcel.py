"""dumps/loads: pickled requests whose tensors travel through the pool, between real processes."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import time
import warnings

import pytest
import torch

from mmfeat.client import MmfeatError, Pooled, dumps, loads

from . import parcel_workers as w
from .conftest import run_ready_child
from .ttls import ran_out, ttls


def test_requests_reach_two_ranks_over_zmq_with_every_tensor_intact(daemon, children) -> None:
    import zmq

    ctx = zmq.Context()
    pushes = [ctx.socket(zmq.PUSH) for _ in range(2)]
    endpoints = []
    for k, s in enumerate(pushes):
        endpoints.append(f"ipc://{daemon.runtime_dir}/rank{k}.sock")
        s.bind(endpoints[-1])
    spawn = children
    results = spawn.Queue()
    ranks = [spawn.Process(target=w.rank, args=(str(daemon.runtime_dir), ep, 12, results)) for ep in endpoints]
    for p in ranks:
        p.start()
    with daemon.client() as c:  # the default threshold: images and the mask pooled, the rest pickled
        for rid in range(12):
            data = dumps(w.make_request(rid), consumers=2, client=c)
            assert len(data) < 20_000, len(data)  # descriptors, not pixels
            for s in pushes:
                s.send(data)
        assert [results.get(timeout=120) for _ in ranks] == [0, 0]
        for p in ranks:
            p.join(30)
            assert p.exitcode == 0
        s = daemon.stats()
        assert s["leases"] == {"RESERVED": 0, "PUBLISHED": 0} and s["counters"]["publishes"] == 12
    for s in pushes:
        s.close(0)
    ctx.term()
    assert daemon.pool()["used"] == 0


def test_small_tensors_stay_in_the_pickle_and_copies_outlive_the_ack(daemon) -> None:
    with daemon.client() as c:
        obj = {"small": torch.arange(10), "grad": torch.ones(300_000, requires_grad=True), "big": torch.ones(300_000)}
        data = dumps(obj, client=c)
        parcel = loads(data, client=c)
        value = parcel.value
        assert torch.equal(value["small"], obj["small"]) and value["grad"].requires_grad
        private = parcel.copy()
        parcel.ack()
        parcel.ack()  # again: nothing
        assert c.flush()
        assert daemon.stats()["counters"]["acks"] == 1
        assert torch.equal(private["big"], obj["big"])
        assert loads(dumps({"k": 1}, client=c), client=c).value == {"k": 1}  # nothing pooled, nothing to ack
        with pytest.raises(MmfeatError):
            loads(pickle.dumps(obj["small"]), client=c)


def test_one_rank_acks_for_its_group(daemon) -> None:
    """An encoder owner that serves a group of ranks acks for all of them; the others never read it."""
    with daemon.client() as c:
        data = dumps({"x": torch.ones(300_000)}, consumers=4, client=c)
        owner = loads(data, client=c)
        assert torch.equal(owner.value["x"], torch.ones(300_000))
        owner.ack(count=4)
        owner.ack(count=4)  # again: nothing
        assert c.flush()
        s = daemon.stats()
        assert s["counters"]["acks"] == 4 and s["counters"]["over_acks"] == 0 and s["leases"]["PUBLISHED"] == 0
    assert daemon.pool()["used"] == 0


def test_an_ack_refused_for_its_arguments_leaves_the_parcel_to_ack_again(daemon) -> None:
    """A bad count or ``after`` is the caller's mistake and acks nothing: the Parcel is still unacked, so a
    corrected ack() goes through instead of being taken for a repeat."""
    with daemon.client() as c:
        parcel = loads(dumps({"x": torch.ones(300_000)}, client=c), client=c)
        with pytest.raises(ValueError):
            parcel.ack(count=0)
        with pytest.raises(TypeError):
            parcel.ack(after="the default stream")
        assert not parcel.acked
        parcel.ack()
        assert parcel.acked and c.flush()
        s = daemon.stats()
        assert s["counters"]["acks"] == 1 and s["leases"]["PUBLISHED"] == 0

def test_a_forgotten_parcel_acks_when_collected_and_warns_once(daemon) -> None:
    from mmfeat.client.parcel import forget_warned

    forget_warned()  # this process may have warned in an earlier test
    with daemon.client() as c:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                loads(dumps({"x": torch.ones(300_000)}, client=c), client=c)  # dropped at once
                gc.collect()
        # Only ours: a collection may also finish off other tests' leftovers, which warn too.
        assert sum(issubclass(x.category, ResourceWarning) and "mmfeat Parcel" in str(x.message) for x in caught) == 1
        assert c.flush()
        s = daemon.stats()
        assert s["counters"]["acks"] == 3 and s["leases"]["PUBLISHED"] == 0


def test_a_rank_that_dies_holding_a_parcel_costs_ack_ttl(daemon_factory) -> None:
    for ttl in ttls(3.0):
        d = daemon_factory("--pool-mb", "64", "--ack-ttl", str(ttl))
        with d.client() as c:
            code = "from mmfeat.client import loads; p = loads(arg, client=c); os.kill(os.getpid(), signal.SIGKILL)"
            put_at: list[float] = []

            def put() -> bytes:
                put_at.append(time.monotonic())
                return dumps({"x": torch.ones(300_000)}, client=c)

            out = run_ready_child(code, d.runtime_dir, put)
            if not ran_out(out.stderr, put_at[0], ttl):
                assert out.returncode == -signal.SIGKILL, out.stderr
                s = d.wait_for(lambda s: s["counters"]["expired"] == 1, what="ack_ttl")
                assert s["leases"]["PUBLISHED"] == 0
                return
        assert d.stop() == 0  # the rank read only after ack_ttl: again, with a longer one
    pytest.fail(f"the rank read after ack_ttl {ttl} s too: {out.stderr}")


def test_a_multiprocessing_queue_moves_pooled_objects_through_the_pool(daemon, monkeypatch) -> None:
    monkeypatch.setenv("MMFEAT_RUNTIME_DIR", str(daemon.runtime_dir))
    spawn = mp.get_context("spawn")
    q, results = spawn.Queue(), spawn.Queue()
    child = spawn.Process(target=w.from_queue, args=(str(daemon.runtime_dir), q, results))
    child.start()
    with daemon.client() as c:
        q.put(Pooled(w.make_request(5), client=c))
        assert results.get(timeout=120) is True
        child.join(30)
        assert child.exitcode == 0
        s = daemon.stats()
        assert s["counters"]["publishes"] == 1 and s["leases"]["PUBLISHED"] == 0
    assert os.environ["MMFEAT_RUNTIME_DIR"] == str(daemon.runtime_dir)


def test_tensors_from_a_dropped_parcel_keep_their_feature_until_they_die(daemon, children) -> None:
    """``loads(data).value`` drops the Parcel at once; its tensors still read the producer's bytes after
    the producer has put over every range an early ack would have freed, and the ack comes when they die."""
    inbox, outbox = children.Queue(), children.Queue()
    consumer = children.Process(target=w.keeps_only_the_value, args=(str(daemon.runtime_dir), inbox, outbox))
    consumer.start()
    try:
        with daemon.client() as c:
            shape = (3, 64, 512)  # 384 KiB each: above the inline threshold
            inbox.put(dumps({"pixel_values": [torch.full(shape, 7.0) for _ in range(2)]}, client=c))
            assert outbox.get(timeout=120) == "held"
            s = daemon.stats()
            assert s["leases"]["PUBLISHED"] == 1 and s["counters"]["acks"] == 0, s  # not acked while read
            for _ in range(64):  # rings around every arena; a freed feature's range is written over
                c.ack(c.put(torch.full(shape, float(0xEE))))
            assert c.flush()
            inbox.put("overwritten")
            assert outbox.get(timeout=60) is True, "a tensor read bytes another feature wrote"
            assert outbox.get(timeout=60) == "dropped"
            s = daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the ack once the tensors died")
            assert s["counters"]["acks"] == 65
        consumer.join(30)
        assert consumer.exitcode == 0
        daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the pool back to empty")
    finally:
        if consumer.is_alive():
            consumer.kill()


def test_the_automatic_ack_takes_no_lock_the_freeing_thread_may_hold(daemon, children) -> None:
    inbox, outbox = children.Queue(), children.Queue()
    consumer = children.Process(target=w.drops_the_last_tensor_inside_the_clients_lock,
                                args=(str(daemon.runtime_dir), inbox, outbox))
    consumer.start()
    try:
        with daemon.client() as c:
            inbox.put(dumps({"x": torch.ones(300_000)}, client=c))
            consumer.join(60)
            assert consumer.exitcode == 0, "the consumer hung acking under its own lock"
            assert outbox.get(timeout=10) is True
            daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the automatic ack")
    finally:
        if consumer.is_alive():
            consumer.kill()
            consumer.join(10)


def test_a_forked_child_that_drops_its_copy_of_a_parcel_does_not_ack_it(daemon) -> None:
    """A fork copies the Parcel and its tensors; the copy the child frees is not the parent's feature to
    ack: an ack from there would free the memory the parent still reads."""
    with daemon.client() as c:
        code = ("import gc; from mmfeat.client import loads; p = loads(arg, client=c); pid = os.fork()\n"
                "if pid == 0:\n"
                "    del p; gc.collect(); c.flush(); os._exit(0)\n"
                "_, status = os.waitpid(pid, 0); s = c.stats()\n"
                "print(status, s['counters']['acks'], s['leases']['PUBLISHED'], flush=True)\n"
                "p.ack(); c.flush(); s = c.stats()\n"
                "print(s['counters']['acks'], s['counters']['over_acks'], s['leases']['PUBLISHED'], flush=True)\n")
        out = run_ready_child(code, daemon.runtime_dir, lambda: dumps({"x": torch.ones(300_000)}, client=c))
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[:2] == ["0 0 1", "1 0 0"], (out.stdout, out.stderr)


def test_tensors_freed_after_their_client_closed_ack_without_reopening_it(daemon) -> None:
    """The tensors outlive ``close()`` (they hold the pool's pages); when they go, the ack is a store into the
    table that is still mapped, from whichever thread frees them: no session is opened there (a round
    trip inside a garbage collection, and fds that nobody closes)."""
    with daemon.client() as c:
        code = ("import gc; from mmfeat.client import Client, loads; from tests.conftest import fd_count\n"
                "with Client(sys.argv[1]) as c2:\n"
                "    v = loads(arg, client=c2).value\n"
                "before = fd_count(os.getpid()); del v; gc.collect()\n"
                "print(c2._session is None, fd_count(os.getpid()) - before, flush=True)\n")
        out = run_ready_child(code, daemon.runtime_dir, lambda: dumps({"x": torch.ones(300_000)}, client=c))
        assert out.returncode == 0, out.stderr
        no_session, more_fds = out.stdout.split("\n")[0].split()
        assert no_session == "True" and int(more_fds) <= 0, (out.stdout, out.stderr)
        s = daemon.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the ack of the freed tensors")
        assert s["counters"]["acks"] == 1 and s["counters"]["over_acks"] == 0


def test_a_process_that_exits_holding_parcels_acks_them_on_its_way_out(daemon_factory) -> None:
    """Python frees nothing that module globals still hold at a normal exit (a Parcel, a view of its
    tensor, a numpy array over another's): without an ack at exit each feature stayed until ack_ttl."""
    d = daemon_factory("--pool-mb", "64", "--ack-ttl", "600")
    with d.client() as c:
        code = ("from mmfeat.client import loads; P = loads(arg, client=c); V = P.value['x'][::2]; "
                "N = loads(arg, client=c).value['x'].numpy(); sys.exit(0)")
        out = run_ready_child(code, d.runtime_dir, lambda: dumps({"x": torch.ones(300_000)}, consumers=2, client=c))
        assert out.returncode == 0, out.stderr
        s = d.wait_for(lambda s: s["leases"]["PUBLISHED"] == 0, what="the acks at exit")
        assert s["counters"]["acks"] == 2 and s["counters"]["over_acks"] == 0 and s["counters"]["expired"] == 0


def test_saving_a_parcels_tensor_writes_its_bytes_not_the_pool(daemon) -> None:
    """A get() view's storage is the whole pool (torch.save of one writes every feature there); a
    Parcel's tensors have storages of their own, over their own bytes."""
    import io

    with daemon.client() as c:
        c.ack(c.put(torch.full((300_000,), 42.0)))  # another feature, which must not travel along
        with loads(dumps({"x": torch.arange(300_000, dtype=torch.float32)}, client=c), client=c) as value:
            buf = io.BytesIO()
            torch.save(value["x"][10:20], buf)
            pickled = pickle.dumps(value["x"])
        assert len(buf.getvalue()) < 2 * 1_200_000 and len(pickled) < 2 * 1_200_000
        buf.seek(0)
        assert torch.equal(torch.load(buf), torch.arange(10, 20, dtype=torch.float32))
        assert torch.equal(pickle.loads(pickled), torch.arange(300_000, dtype=torch.float32))
