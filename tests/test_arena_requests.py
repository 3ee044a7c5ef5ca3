"""A frozen daemon while a producer asks for its next arena: the put falls back once, and its space
in the arena comes back (tests/test_arenas.py has the arenas' other guarantees)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time

from typing import Iterator

import torch

from .test_arenas import _no_features


@contextlib.contextmanager
def _frozen_with_a_full_fd_channel(daemon, session) -> Iterator[None]:
    """The daemon stopped and the session's fd channel full (its socket buffer): the next request sent on
    it waits out the client's timeout."""
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        while session.fd.try_send("ping"):
            pass
        yield
    finally:
        daemon.proc.send_signal(signal.SIGCONT)


def test_a_put_whose_request_for_the_next_arena_times_out_hands_its_space_back(daemon) -> None:
    """The put that fills an arena past half asks for the next one. If that request times out (a frozen
    daemon with a full fd channel), the put goes inline and its space in the arena comes back: a range
    left placed but never published would hold the arena's ring, and the arena itself, for good."""
    with daemon.client(inline_threshold=0, timeout=1.0) as producer, daemon.client(timeout=5.0) as consumer:
        warm = producer.put(torch.zeros(1000))
        consumer.ack(warm)
        held = [producer.put(torch.full((1 << 18,), float(k))) for k in range(4)]  # 4 MiB: half the 8 MiB arena
        assert not any(d.is_inline for d in held)
        session = producer.session
        with _frozen_with_a_full_fd_channel(daemon, session):
            desc = producer.put(torch.ones(1 << 18))  # past half: asks for the next arena, in vain
        assert desc.is_inline and producer.fallbacks["unreachable"] == 1
        for d in held:
            consumer.ack(d)
        daemon.wait_for(_no_features, what="the held features to end")
        (arena,) = session.arenas._arenas[0]
        arena.reclaim()
        assert arena.used == 0 and not arena.writing(), "the inline put's range still holds the arena"


def test_a_put_placed_past_the_first_arena_whose_ask_ahead_times_out_hands_its_space_back(daemon) -> None:
    """As above, for a feature that the first arena cannot take: a feature of a larger size class placed
    in its own class's arena, which that feature fills past half. Its request for the next arena of the
    class times out; the put goes inline, and its range in the class's arena comes back."""
    mib = 1 << 18  # float32 elements in 1 MiB
    with daemon.client(inline_threshold=0, timeout=1.0) as producer, daemon.client(timeout=5.0) as consumer:
        consumer.ack(producer.put(torch.zeros(1000)))  # the usual 8 MiB arena
        first = producer.put(torch.zeros(5 * mib))  # over half of it: an arena of its own, 16 MiB, first
        held = [producer.put(torch.full((3 * mib,), float(k))) for k in range(3)]  # 14 MiB of the 16
        held.append(producer.put(torch.full((3 * mib,), 3.0)))  # no room left there: the usual arena, now first
        assert not any(d.is_inline for d in [first, *held]) and held[-1].pool == first.pool
        consumer.ack(first)  # 5 MiB free again at the start of the 16 MiB arena
        session = producer.session
        large = next(a for a in session.arenas._arenas[0] if a.size == 16 << 20)
        with _frozen_with_a_full_fd_channel(daemon, session):
            # Too large for the usual arena: placed in the 16 MiB one past its first, then 14 MiB full, it
            # asks for another of its class, in vain.
            desc = producer.put(torch.ones(5 * mib))
        assert desc.is_inline and producer.fallbacks["unreachable"] == 1
        for d in held:
            consumer.ack(d)
        daemon.wait_for(_no_features, what="the held features to end")
        large.reclaim()
        assert large.used == 0 and not large.writing(), "the inline put's range still holds the arena"


def test_puts_queued_behind_a_timed_out_ask_ahead_do_not_each_wait_out_a_timeout(daemon) -> None:
    """Threads sharing a Client wait for the arenas' lock while one put's request for the next arena
    times out (a frozen daemon with a full fd channel). That put falls back; the others do not ask
    again, each waiting out a timeout of its own behind the last (four puts took four timeouts), but
    place their features in the arena, which needs no daemon."""
    with daemon.client(inline_threshold=0, timeout=1.0) as producer, daemon.client(timeout=5.0) as consumer:
        consumer.ack(producer.put(torch.zeros(1000)))
        held = [producer.put(torch.full((1 << 18,), float(k))) for k in range(4)]  # 4 MiB: half the 8 MiB arena
        session = producer.session
        descs: dict[int, object] = {}

        def put(k: int) -> None:
            descs[k] = producer.put(torch.full((1 << 16,), float(k)))

        threads = [threading.Thread(target=put, args=(k,)) for k in range(4)]
        with _frozen_with_a_full_fd_channel(daemon, session):
            with session.arenas._lock:  # all four queue for the lock before the first asks ahead
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 30
                while not all(sys._current_frames()[t.ident].f_code.co_name == "place_now" for t in threads):
                    assert time.monotonic() < deadline, "the puts never reached the arenas' lock"
                    time.sleep(0.01)
            for t in threads:
                t.join(60)
        assert sorted(descs) == [0, 1, 2, 3] and producer.fallbacks["unreachable"] == 1, producer.fallbacks
        for k, desc in descs.items():
            assert torch.equal(consumer.get(desc), torch.full((1 << 16,), float(k)))
            consumer.ack(desc)
        for d in held:
            consumer.ack(d)
        daemon.wait_for(_no_features, what="the features to end")
