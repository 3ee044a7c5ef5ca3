"""The pure parts on their own: allocator, ledger arithmetic, descriptor validation, settings layering."""

from __future__ import annotations

import copy
import math
import pickle
import random

import pytest

from mmfeat.daemon.config import ConfigError, load_settings, render_config
from mmfeat.daemon.leases.allocator import Allocator
from mmfeat.daemon.leases.sessions import MAX_PENDING_SESSIONS, PeerCred, SessionTable
from mmfeat.protos import Descriptor, DescriptorError, ErrorCode, MmfeatError, TensorSpec


def test_allocator_matches_a_reference_model() -> None:
    rng = random.Random(7)
    a = Allocator(1 << 20)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and (rng.random() < 0.45 or a.free < 4096):
            off = rng.choice(list(live))
            assert a.release(off) == live.pop(off)
        else:
            n = rng.choice([1, 255, 256, 257, 1000, 4096, 70_000])
            off = a.alloc(n)
            if off is None:
                assert a.largest_free < -(-n // 256) * 256
                continue
            assert off % 256 == 0
            size = -(-n // 256) * 256
            for o, s in live.items():  # no overlap with anything live
                assert off + size <= o or o + s <= off
            live[off] = size
        assert a.used == sum(live.values())
        if live and rng.random() < 0.02:  # what evictions would free, foreseen: as releasing them does
            some = rng.sample(sorted(live.items()), rng.randint(1, len(live)))
            after = copy.deepcopy(a)
            for off, _ in some:
                after.release(off)
            assert a.largest_after(some) == after.largest_free
    for off in list(live):
        a.release(off)
    assert a.used == 0 and a.largest_free == a.capacity and a.free_ranges == 1


def test_allocator_best_fit_and_double_free() -> None:
    a = Allocator(10 * 256)
    offs = [a.alloc(256) for _ in range(10)]
    a.release(offs[1])  # hole of 1
    a.release(offs[4])
    a.release(offs[5])  # hole of 2
    assert a.alloc(256) == offs[1], "best fit takes the smallest hole that fits"
    assert a.alloc(512) == offs[4]
    with pytest.raises(KeyError):
        a.release(offs[1] + 1)
    assert a.alloc(256) is None


def _desc(**kw) -> Descriptor:
    base = dict(kind="host", tensors=(TensorSpec("float32", (2, 3), (3, 1), 0),), nbytes=24, node="n", endpoint="ipc://x",
                pool=0, epoch=5, lease=1, gen=2, token=b"k" * 16, offset=512)
    base.update(kw)
    return Descriptor(**base)


def test_descriptor_round_trip_and_pickle() -> None:
    d = _desc()
    assert Descriptor.from_bytes(d.to_bytes()) == d
    assert pickle.loads(pickle.dumps(d)) == d
    assert len(d.to_bytes()) < 100
    inline = Descriptor(kind="inline", tensors=(TensorSpec("uint8", (3,), (1,), 0),), nbytes=3, inline=b"abc")
    assert Descriptor.from_bytes(inline.to_bytes()).inline == b"abc"


def test_a_descriptors_repr_leaves_its_token_out() -> None:
    """The token lets whoever holds it ack the lease; a repr ends up in logs and tracebacks."""
    d = _desc(token=bytes(range(16)))
    text = repr(d)
    assert "token" not in text and repr(bytes(range(16))) not in text and "\\x0f" not in text
    assert "lease=1" in text and "gen=2" in text  # what names the feature stays


@pytest.mark.parametrize(
    "bad",
    [
        dict(tensors=(TensorSpec("float32", (2, 4), (4, 1), 0),)),  # 32 B in a 24 B lease
        dict(tensors=(TensorSpec("float32", (2, 3), (3, 1), 8),)),  # shifted past the end
        dict(tensors=(TensorSpec("float33", (1,), (1,), 0),)),
        dict(tensors=(TensorSpec("float32", (1,), (1,), 2),)),  # misaligned
        dict(token=b"short"),
        dict(kind="gpu"),
        dict(kind="inline"),  # no bytes
        dict(tensors=()),
    ],
)
def test_descriptor_validation_rejects(bad) -> None:
    with pytest.raises(DescriptorError):
        Descriptor.from_bytes(_desc(**bad).to_bytes())


def test_descriptor_rejects_garbage() -> None:
    for blob in (b"", b"\xc1", b"\x93\x01\x02\x03", bytes(range(200))):
        with pytest.raises(DescriptorError):
            Descriptor.from_bytes(blob)


def test_settings_layers_and_sources(tmp_path) -> None:
    cfg = tmp_path / "m.toml"
    cfg.write_text('[mmfeatd]\npool_mb = 64\nack_ttl = 9.5\nsocket_mode = "0640"\n')
    s, src = load_settings(cfg, {"ack_ttl": 3.0}, environ={"MMFEAT_POOL_MB": "32", "MMFEAT_DEVICES": "0,2"})
    assert (s.pool_mb, s.ack_ttl, s.devices, s.socket_mode) == (32, 3.0, [0, 2], 0o640)
    assert src["pool_mb"] == "environment MMFEAT_POOL_MB" and src["ack_ttl"] == "flag"
    assert src["socket_mode"].startswith("file") and src["reserve_ttl"] == "default"
    text = render_config(s, src)
    assert "pool_mb = 32  # from environment MMFEAT_POOL_MB" in text


@pytest.mark.parametrize(
    "environ,flags,needle",
    [
        ({"MMFEAT_POOL_MB": "-1"}, {}, "pool_mb (from environment MMFEAT_POOL_MB)"),
        ({"MMFEAT_POOL_MB": "lots"}, {}, "pool_mb"),
        ({}, {"ack_ttl": 0.0}, "ack_ttl (from flag)"),
        ({"MMFEAT_DEVICES": "0,x"}, {}, "devices"),
        ({"MMFEAT_BACKEND": "tpu"}, {}, "backend"),
    ],
)
def test_invalid_settings_name_the_setting(environ, flags, needle) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, flags, environ=environ)
    assert needle in str(info.value)


def test_unknown_key_in_file(tmp_path) -> None:
    cfg = tmp_path / "m.toml"
    cfg.write_text("[mmfeatd]\npool_gb = 1\n")
    with pytest.raises(ConfigError, match="pool_gb"):
        load_settings(cfg, {}, environ={})


def test_ledger_state_accounting_and_fits_match_a_walk() -> None:
    from mmfeat.daemon.leases.arenas import Arenas
    from mmfeat.daemon.leases.counters import Counters
    from mmfeat.daemon.leases.lease import LeaseState
    from mmfeat.daemon.leases.ledger import Ledger
    from mmfeat.daemon.leases.session_books import SessionBooks
    from mmfeat.daemon.leases.slots import SlotSpace
    from mmfeat.protos.messages import LeaseRef

    rng = random.Random(3)
    allocators, counters, space = {0: Allocator(1 << 20), 1: Allocator(1 << 18)}, Counters(), SlotSpace(1000, 256)
    books = SessionBooks(counters)
    ledger = Ledger(allocators, 9, counters, 5.0, 5.0, space, Arenas(allocators, space, counters, books, 0, 4), books)
    live = []
    for step in range(3000):
        op = rng.random()
        if op < 0.4 or not live:
            pool, nbytes = rng.choice([0, 1]), rng.randint(1, 9000 if rng.random() < 0.9 else 300_000)
            fits = ledger.fits(pool, nbytes)  # what a pull asks before it sweeps for room
            try:
                lease = ledger.reserve(b"s" * 16, pool, nbytes, rng.randint(1, 3), now=step * 0.01)
            except Exception:
                assert not fits, (pool, nbytes)
                continue
            assert fits, (pool, nbytes)
            live.append(lease)
        else:
            lease = rng.choice(live)
            ref = LeaseRef(pool=lease.pool_id, epoch=9, lease=lease.lease_id, gen=lease.gen, token=lease.token,
                           offset=lease.offset, nbytes=lease.nbytes)
            if lease.state is LeaseState.RESERVED and op < 0.7:
                try:
                    ledger.publish(ref, b"s" * 16, now=step * 0.01)
                except MmfeatError as exc:  # past its reserve_ttl: refused, and its kept range freed
                    assert exc.code is ErrorCode.STALE and lease.overdue and ledger.live_lease(lease.lease_id) is None
            elif op < 0.9:
                ledger.ack(ref, rng.randint(1, 2), now=step * 0.01)
            else:
                ledger.release(ref, b"s" * 16, now=step * 0.01)
        ledger.expire(now=step * 0.01)
        live = [x for x in live if ledger.live_lease(x.lease_id) is x]
        for pool in (0, 1):
            walked = {st.value: 0 for st in LeaseState}
            walked_bytes = {st.value: 0 for st in LeaseState}
            for x in live:
                if x.pool_id == pool:
                    walked[x.state.value] += 1
                    walked_bytes[x.state.value] += ledger.allocators[pool].size_of(x.offset)
            assert ledger.count_by_state(pool) == walked and ledger.bytes_by_state(pool) == walked_bytes
            assert sum(walked_bytes.values()) == ledger.allocators[pool].used


def test_session_table_drops_the_oldest_waiting_and_keeps_attached() -> None:
    table = SessionTable()
    first, dropped = table.open("a", 1, now=0.0)
    assert dropped == []
    table.attach(first.token, PeerCred(1, 0, 0))
    waiting = [table.open("w", 2, now=1.0 + i)[0] for i in range(MAX_PENDING_SESSIONS)]
    newest, dropped = table.open("n", 3, now=1e6)
    assert dropped == [waiting[0]] and table.get(waiting[0].token) is None and table.get(newest.token) is newest
    assert table.attached_count() == 1 and table.pending_count() == MAX_PENDING_SESSIONS
    # The grace expiry drops waiting sessions created before the cutoff, never attached ones.
    assert table.drop_unattached_before(cutoff=1.0 + 100) == 99
    assert table.get(first.token) is first and table.get(waiting[99].token) is None and table.get(waiting[100].token)
    assert table.close(first.token) is first and table.attached_count() == 0


def test_the_sweep_interval_follows_the_rate_within_its_bounds() -> None:
    """While clients write, each sweep should apply a batch: the interval halves while sweeps find more
    than SWEEP_BATCH, doubles while they find fewer, and never leaves [SWEEP_MIN_S, longest] (SWEEP_MAX_S,
    or a meshed daemon's shorter bound, which a remote consumer's relayed ack waits for)."""
    from mmfeat.daemon.cadence import MESH_TICK_S, SWEEP_BATCH, SWEEP_MAX_S, SWEEP_MIN_S, sweep_interval

    every, seen = SWEEP_MAX_S, []
    for _ in range(10):  # a burst: many words per sweep
        every = sweep_interval(every, SWEEP_BATCH[1] + 1)
        seen.append(every)
    assert seen[0] == SWEEP_MAX_S / 2 and every == SWEEP_MIN_S and min(seen) == SWEEP_MIN_S
    assert sweep_interval(every, (SWEEP_BATCH[0] + SWEEP_BATCH[1]) // 2) == every  # a batch: keep it
    for _ in range(10):  # a trickle: one word per sweep
        every = sweep_interval(every, 1)
    assert every == SWEEP_MAX_S
    for _ in range(10):
        every = sweep_interval(every, 0)
    assert every == SWEEP_MAX_S
    for applied in (0, 1, (SWEEP_BATCH[0] + SWEEP_BATCH[1]) // 2, SWEEP_BATCH[1] + 1):  # a meshed daemon
        assert SWEEP_MIN_S <= sweep_interval(SWEEP_MAX_S, applied, MESH_TICK_S) <= MESH_TICK_S


def test_one_tensors_layout_from_the_cache_is_the_one_it_would_build() -> None:
    """put() takes a single tensor's spec from a cache keyed by dtype and shape: the same dtype with another
    shape, the same shape in another dtype, and a non-contiguous input (packed contiguous) each get their
    own, the spec that a put of several tensors builds afresh for its first."""
    import torch

    from mmfeat.client.produce import packing

    cases = [torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.float16), torch.zeros(4, 3), torch.zeros(4, 3).t(),
             torch.zeros(0, 5, dtype=torch.int64), torch.zeros((), dtype=torch.bfloat16)]
    for t in cases * 2:  # the second pass reads the cache
        (spec,), nbytes = packing.layout([t])
        assert spec == packing.layout([t, t])[0][0] and nbytes == t.numel() * t.element_size()
    assert packing.layout([cases[0]])[0][0] != packing.layout([cases[1]])[0][0]
    # The very tuple again for the same layout: the descriptor encoder keeps a tail's bytes by that tuple.
    assert packing.layout([torch.ones(3, 4)])[0] is packing.layout([cases[0]])[0]
    for n in range(packing.LAYOUT_CACHE_ENTRIES + 8):  # more shapes than it keeps: it starts again, and stays bounded
        spec = TensorSpec("uint8", (n + 1,), (1,), 0)
        assert packing.layout([torch.zeros(n + 1, dtype=torch.uint8)]) == ((spec,), n + 1)
    assert 0 < packing.layout_cache_len() <= packing.LAYOUT_CACHE_ENTRIES


def test_timers_wake_the_loop_only_for_those_that_wake_it() -> None:
    """The loop sleeps until the earliest timer that wakes it; a status line or a heap trim rides on a
    wake-up something else caused, and a job the loop does not have is never due."""
    from mmfeat.daemon.timers import Timers

    timers = Timers()
    assert timers.wake_at() == math.inf
    timers.add("tick", 5.0)
    timers.add("status", 1.0, wakes=False)
    assert timers.wake_at() == 5.0 and timers.due("status", 1.0) and not timers.due("tick", 4.9)
    timers.not_after("tick", 7.0)
    assert timers["tick"] == 5.0
    timers.not_after("tick", 2.0)
    assert timers.wake_at() == 2.0
    assert not timers.due("watchdog", 100.0)
    with pytest.raises(KeyError):
        timers["watchdog"] = 1.0
    with pytest.raises(ValueError):
        timers.add("tick", 1.0)


def test_put_tokens_are_fresh_and_a_forked_child_draws_its_own() -> None:
    """Producers draw tokens (the capability to ack or release a feature) from the kernel several at a
    time: each is new, and a child forked mid-draw hands out none of the tokens its parent will."""
    import os

    from mmfeat.client.produce.put_in_flight import new_token

    seen = {new_token() for _ in range(1000)}
    assert len(seen) == 1000 and all(len(t) == 16 for t in seen)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next tokens, to the parent
        os.close(read)
        os.write(write, b"".join(new_token() for _ in range(8)))
        os._exit(0)
    os.close(write)
    child = b""
    while chunk := os.read(read, 4096):
        child += chunk
    os.close(read)
    os.waitpid(pid, 0)
    parent = b"".join(new_token() for _ in range(8))
    assert len(child) == 128 and child != parent
    assert not {child[i : i + 16] for i in range(0, 128, 16)} & {parent[i : i + 16] for i in range(0, 128, 16)}


def test_the_memory_guard_lets_only_a_reset_raise_its_base() -> None:
    """After a reset the guard settles again as what the reset dropped is freed. What peers hold at those
    later moments is in their budget already: taking it into the base would count it twice, and a peer
    that knows the schedule could ratchet the guard up reset by reset. This process's own memory plays
    the daemon's: held at the reset, freed, then more held at the later settle."""
    from mmfeat.daemon.sockets.budgets import SETTLE_AFTER_S, MemoryGuard

    guard = MemoryGuard(64 << 20)
    start = guard.base
    held = bytearray(b"\x01") * (160 << 20)  # filled, so resident
    guard.reset_at(0.0)
    at_reset = guard.base
    assert at_reset > start + (100 << 20)  # what is still being freed must not trip the guard again
    del held
    later = bytearray(b"\x02") * (320 << 20)  # more than at the reset, held at the next settle
    guard.settle(SETTLE_AFTER_S[0])
    assert guard.base <= at_reset, f"a later settle raised the base by {(guard.base - at_reset) >> 20} MiB"
    del later
    for delay in SETTLE_AFTER_S[1:]:
        guard.settle(delay)
    assert guard.base < start + (64 << 20), "the base did not come back down once the memory went back"
    guard.close()
