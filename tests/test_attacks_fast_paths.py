"""Attacks on the per-feature fast paths: a put interrupted midway, threads sharing one Client while
arenas fill and spill, and every one-byte change of real descriptors against the full parse."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from mmfeat.protos import ErrorCode, MmfeatError, descriptor
from mmfeat.protos.descriptor import Descriptor, DescriptorError


class _FailingCopy(torch.Tensor):
    """A tensor whose memory cannot be read: the copy into the pool raises, as a Ctrl-C during it would."""

    def data_ptr(self) -> int:  # type: ignore[override]
        raise KeyboardInterrupt


class _GrowsWhileCopied(torch.Tensor):
    """A tensor that another thread resizes while put copies it, made certain: it grows to 64 times its
    size the first time put asks whether it is contiguous, after its layout (and its lease) was made."""

    def is_contiguous(self, *args, **kwargs) -> bool:  # type: ignore[override]
        if self.numel() == 1024:
            self.resize_(1 << 16)
        return super().is_contiguous(*args, **kwargs)


def test_a_put_interrupted_during_its_copy_gives_its_slot_and_range_back(daemon_factory) -> None:
    """A put whose copy raises (any BaseException) after its placement returns the placement: with one
    arena of 64 slots, eighty interrupted puts of 256 KiB (more slots and bytes than its 1 MiB) and
    forty complete ones after them all go to that arena."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "1", "--arena-slots", "64", "--arenas-per-session", "1")
    with d.client(inline_threshold=0, fallback="error") as c:
        warm = c.put(torch.ones(4096))
        c.ack(warm)
        for k in range(80):
            try:
                c.put(torch.full((65536,), float(k)).as_subclass(_FailingCopy))
            except KeyboardInterrupt:
                pass
            else:
                raise AssertionError("the failing copy did not raise")
        for k in range(40):
            x = torch.full((4096,), float(k))
            desc = c.put(x)
            assert torch.equal(c.get(desc), x)
            c.ack(desc)
        s = d.stats()
        assert s["counters"]["reserves"] == 0 and s["counters"]["arena_publishes"] == 41, s["counters"]
        assert c.flush()
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the arena to go back")


# Runs in its own process: SIGINT goes to that process's main thread only.
_INTERRUPTED_PUT = r"""
import json, linecache, os, signal, sys, threading, time
import torch
from mmfeat.client import Client
from mmfeat.client.link import arenas
from mmfeat.protos import ErrorCode, MmfeatError

# The expiry waited for below can outlast IDLE_S on a loaded machine: the reaper would then return the
# session's only arena, and the next put reserve, which is what a stopped ring looks like here.
arenas.IDLE_S = 3600.0
ACK_TTL = float(sys.argv[3])
c = Client(sys.argv[1], inline_threshold=0, fallback="error", timeout=5.0)
first = c.put(torch.ones(4096))
c.ack(first)
arenas = c.session.arenas
held, returned = threading.Event(), threading.Event()
MAIN = threading.main_thread().ident
interrupted = False


def interrupt(signum, frame):
    # One KeyboardInterrupt, however many SIGINTs it took to reach the main thread in its wait.
    global interrupted
    if not interrupted:
        interrupted = True
        raise KeyboardInterrupt


signal.signal(signal.SIGINT, interrupt)


def at_the_lock():
    # Whether the main thread's innermost frame is at a "with self._lock:" of the arenas, waiting for it.
    f = sys._current_frames().get(MAIN)
    return f is not None and linecache.getline(f.f_code.co_filename, f.f_lineno).strip().startswith("with self._lock")


def hold_lock_then_interrupt():
    # Events, not times: a busy machine can pause the main thread for longer than any fixed wait.
    with arenas._lock:
        held.set()
        deadline = time.monotonic() + 60
        # The put has copied (or failed to) and waits for the lock, if it takes it there, or returned.
        while not (returned.is_set() or at_the_lock()):
            if time.monotonic() > deadline:
                print("put neither returned nor waited for the arenas' lock", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.001)
        signal.pthread_kill(MAIN, signal.SIGINT)
        # Held until the interrupt has landed in that wait. A SIGINT that came just before the thread
        # blocked in the lock wakes nothing: another one does.
        while at_the_lock() and time.monotonic() < deadline:
            time.sleep(0.05)
            signal.pthread_kill(MAIN, signal.SIGINT)


helper = threading.Thread(target=hold_lock_then_interrupt, daemon=True)


class GrabLock(torch.Tensor):
    def data_ptr(self):  # the copy: after placement, before publish
        helper.start()
        held.wait(30)
        if sys.argv[2] == "abandon":
            raise RuntimeError("the copy failed")  # put then gives the placement back
        return super().data_ptr()


try:
    c.put(torch.ones(4096).as_subclass(GrabLock))  # its descriptor, if it returns one, is never acked
    returned.set()
    helper.join()  # the interrupt lands here where put did not wait for the lock
    sys.exit("no interrupt")
except KeyboardInterrupt as exc:
    assert sys.argv[2] == "publish" or isinstance(exc.__context__, RuntimeError), repr(exc.__context__)
# A feature published with nobody to ack it (publish) ends after ack_ttl.
deadline = time.monotonic() + 60
while c.stats()["leases"]["PUBLISHED"]:
    assert time.monotonic() < deadline, "the interrupted feature never expired"
    time.sleep(0.1)
for k in range(40):  # 10 MiB in all: ten times the arena, which each ack gives back
    x = torch.full((65536,), float(k))
    put_at = time.monotonic()
    d = c.put(x)
    try:
        got = c.get(d)
    except MmfeatError as exc:  # a busy machine paused this thread past ack_ttl since the put
        assert exc.code is ErrorCode.NOT_FOUND and time.monotonic() - put_at > ACK_TTL, exc
    else:
        assert torch.equal(got, x)
        c.ack(d)
assert c.flush()
print(json.dumps(c.stats()["counters"]), flush=True)
c.close()
"""


@pytest.mark.parametrize("where", ["publish", "abandon"])
def test_a_put_interrupted_while_waiting_for_the_arenas_lock_does_not_stop_its_ring(daemon_factory, where) -> None:
    """A KeyboardInterrupt that lands in put while it waits for the arenas' lock, after its feature's
    STATE word is stored (publish) or after its copy failed (abandon), leaves either a published feature
    nobody holds, which the daemon expires, or a placement nobody will write: its ring goes on past both.
    Were either still counted as being written, its arena's ring would stop there for good: every later
    feature would reserve, and the arena would never go back while idle."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "1", "--arena-slots", "64", "--arenas-per-session", "1",
                       "--ack-ttl", "1")
    run = subprocess.run([sys.executable, "-c", _INTERRUPTED_PUT, str(d.runtime_dir), where, "1"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    counters = json.loads(run.stdout.strip().splitlines()[-1])
    assert counters["reserves"] == 0 and counters["arena_publishes"] == 41 + (where == "publish"), counters
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the session's arena to go back")


def test_threads_filling_and_spilling_arenas_never_share_a_slot_or_a_byte(daemon_factory) -> None:
    """Four threads put through one Client and hold what they put, so arenas fill, new ones are asked
    for ahead of need, features of a larger class get arenas of their own and others reserve: the fast
    and slow placements interleave. No two live features may share a slot or a byte of the pool."""
    d = daemon_factory("--pool-mb", "64", "--arena-mb", "1", "--arena-slots", "16")
    errors: list[str] = []
    held: list[list[tuple[Descriptor, torch.Tensor]]] = [[] for _ in range(4)]
    with d.client(inline_threshold=0, fallback="error") as producer, d.client() as consumer:
        def work(k: int) -> None:
            try:
                for i in range(40):
                    # Mostly the usual class; every fifth over half an arena (its own class).
                    n = 600 * 1024 if i % 5 == 4 else 1024 * (1 + (i * 7 + k) % 24)
                    x = torch.full((n // 4,), float(k * 1000 + i))
                    held[k].append((producer.put(x), x))
            except Exception as exc:  # reported below: a thread's exception would otherwise vanish
                errors.append(f"thread {k}: {exc!r}")

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:5]
        live = [pair for per_thread in held for pair in per_thread]
        assert len(live) == 160
        slots = [(desc.lease, desc.gen) for desc, _ in live]
        assert len({lease for lease, _ in slots}) == len(slots), "a slot was handed out twice"
        spans = sorted((desc.pool, desc.offset, desc.offset + desc.nbytes) for desc, _ in live)
        for (pa, _, end), (pb, start, _) in zip(spans, spans[1:]):
            assert pa != pb or end <= start, "two live features share bytes"
        for desc, x in live:
            assert torch.equal(consumer.get(desc), x)
            consumer.ack(desc)
        s = d.stats()["counters"]
        # Both ways in: the arenas until their slots ran out, then reserves.
        assert s["arena_publishes"] >= 32 and s["reserves"] > 0 and s["bad_table_words"] == 0, s
        assert consumer.flush() and producer.flush()
    d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the arenas to go back")


def test_every_one_byte_change_of_real_descriptors_parses_as_the_full_parse_does(daemon) -> None:
    """Each byte of descriptors a producer made, set to each of its 256 values: from_bytes (a known head
    and tail, four fields decoded by hand) must accept exactly what the full parse accepts, as the same
    descriptor. Random mutations elsewhere sample this space; here it is covered whole."""
    with daemon.client(inline_threshold=0) as c:
        made = [c.put(torch.ones(1000)), c.put_many([torch.ones(300, dtype=torch.int16), torch.zeros(5, 7)])]
        blobs = [desc.to_bytes() for desc in made]
        for desc in made:
            c.ack(desc)
    for blob in blobs:
        Descriptor.from_bytes(blob)  # a consumer's first parse: the full one, which learns its head and tail
        assert descriptor.parse_known(blob) is not None  # its head and tail are known: the fast parse runs
    checked = agreed_refusals = 0
    for blob in blobs:
        for at in range(len(blob)):
            for value in range(256):
                if value == blob[at]:
                    continue
                bad = blob[:at] + bytes((value,)) + blob[at + 1:]
                try:
                    full = descriptor.parse_in_full(bad)
                except DescriptorError:
                    full = None
                try:
                    fast = Descriptor.from_bytes(bad)
                except DescriptorError:
                    fast = None
                assert (fast is None) == (full is None), (at, value, bad.hex())
                if full is None:
                    agreed_refusals += 1
                else:
                    assert vars(fast) == vars(full), (at, value, bad.hex())
                checked += 1
    assert checked > 50_000 and agreed_refusals > checked // 2, (checked, agreed_refusals)


@pytest.mark.parametrize("consumers", [1.5, 2.0, True, "1", None])
def test_a_put_with_consumers_that_are_not_an_int_is_refused_on_every_path(daemon, consumers) -> None:
    """put and put_many refuse a count of consumers that is not an int (a bool neither) with the error
    reserve gives, whichever path the feature would take: the one-frame path, the general arena path,
    inline, or a lease of its own. The lease table stores an int: a float reached it after the
    feature was placed, raised struct.error, and left the range placed and never published, which
    stopped its arena's ring, and kept the reaper from returning it, for the session's life."""
    with daemon.client(inline_threshold=1024, fallback="error") as c, daemon.client(readonly=True) as consumer:
        consumer.ack(c.put(torch.zeros(100_000)))  # the session's arena, pool mapping and descriptor head
        puts = {"one frame": lambda: c.put(torch.ones(1000), consumers),
                "put_many": lambda: c.put_many([torch.ones(1000)], consumers),
                "inline": lambda: c.put(torch.ones(10), consumers),
                "own lease": lambda: c.put(torch.ones(3 << 20), consumers)}
        for path, put in puts.items():
            with pytest.raises(ValueError, match="consumers must be an int between 1 and"):
                put()
        arenas = [a for pool in c.session.arenas._arenas.values() for a in pool]
        assert arenas and not any(a.writing() for a in arenas), "a refused put left a range placed"
        consumer.ack(c.put(torch.ones(1000), 2), count=2)
        daemon.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="the features to end")


@pytest.mark.parametrize("put", ["put", "put_many"])
def test_a_tensor_resized_during_its_put_never_writes_past_its_lease(daemon, put) -> None:
    """A put copies exactly the bytes its lease was made for, and refuses (BAD_REQUEST) a tensor whose
    size changed meanwhile, on the one-frame path and the general one alike: the general path copied the
    tensor's size at copy time, so one that grew overwrote the next feature in the arena, another
    consumer's, and one that shrank left the end of its lease as the pool's last contents."""
    with daemon.client(inline_threshold=0, fallback="error") as c, daemon.client(readonly=True) as consumer:
        consumer.ack(c.put(torch.zeros(100_000)))  # the session's arena, pool mapping and descriptor head
        first = c.put(torch.ones(1024))
        victim = c.put(torch.full((1 << 16,), 7.0))  # right after it in the arena
        consumer.ack(first)  # the next 4 KiB feature takes its place, just before the victim
        hostile = torch.ones(1024).as_subclass(_GrowsWhileCopied)
        with pytest.raises(MmfeatError) as caught:
            c.put(hostile) if put == "put" else c.put_many([hostile])
        assert caught.value.code is ErrorCode.BAD_REQUEST and "changed size" in str(caught.value)
        assert torch.equal(consumer.get(victim), torch.full((1 << 16,), 7.0)), "the put wrote into the next feature"
        consumer.ack(victim)
        arenas = [a for pool in c.session.arenas._arenas.values() for a in pool]
        assert not any(a.writing() for a in arenas), "the refused put left its range placed"
        daemon.wait_for(lambda s: s["leases"] == {"RESERVED": 0, "PUBLISHED": 0}, what="the features to end")
