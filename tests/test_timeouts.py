"""A frozen daemon: what the client gave up on never takes effect later, and nothing stalls per request."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from mmfeat.client.link.channel import ControlChannel
from mmfeat.protos import DaemonUnavailableError, ErrorCode, MmfeatError


def _frozen(daemon):
    class Frozen:
        def __enter__(self):
            daemon.proc.send_signal(signal.SIGSTOP)

        def __exit__(self, *exc):
            daemon.proc.send_signal(signal.SIGCONT)

    return Frozen()


def test_an_ack_that_timed_out_is_not_applied_later_and_its_retry_counts_once(daemon) -> None:
    # 2 s: the retry after the thaw must not time out on a loaded machine too.
    with daemon.client(inline_threshold=0) as producer, daemon.client(timeout=2.0) as consumer:
        desc = producer.put(torch.ones(5000), consumers=2)
        consumer.connect()
        with _frozen(daemon):
            with pytest.raises(DaemonUnavailableError):
                consumer.ack(desc, wait=True)  # an ack in the table would not need the daemon at all
        # Thawed: the late ack is dropped, and the retry applies once; the other consumer's share stands.
        assert consumer.ack(desc, wait=True) == {"remaining": 1, "freed": False, "over_acked": 0}
        s = daemon.stats()
        assert s["counters"]["late_requests"] == 1 and s["pools"][0]["leases"]["PUBLISHED"] == 1
        assert torch.equal(consumer.get(desc), torch.ones(5000))
        assert producer.ack(desc, wait=True)["freed"]


def test_an_ack_retried_with_its_id_is_applied_once(daemon) -> None:
    # The window deadlines cannot close: the daemon applied the ack, the reply was lost.
    with daemon.client(inline_threshold=0) as c:
        desc = c.put(torch.ones(5000), consumers=3)
        first = c.request("ack", lease=desc.lease_ref(), count=1, ack_id=b"retry-me")
        again = c.request("ack", lease=desc.lease_ref(), count=1, ack_id=b"retry-me")
        assert (first["remaining"], first["duplicate"]) == (2, False)
        assert (again["remaining"], again["duplicate"], again["freed"]) == (2, True, False)
        assert c.ack(desc, count=2, wait=True)["freed"]  # plain acks get fresh ids
        assert daemon.stats()["counters"]["duplicate_acks"] == 1


def test_a_reserve_that_timed_out_holds_no_memory(daemon) -> None:
    with daemon.client(inline_threshold=0, timeout=0.5) as c:
        c.connect()
        with _frozen(daemon):
            d = c.put(torch.ones(100_000))  # times out, goes inline
        assert d.is_inline and c.fallbacks["unreachable"] == 1
        s = daemon.wait_for(lambda s: s["counters"]["late_requests"] == 1, what="the late reserve to be dropped")
        assert s["pools"][0]["used"] == 0 and s["counters"]["reserves"] == 0


def test_a_late_reserve_reply_is_released(daemon) -> None:
    # Without deadlines (a client whose clock differs), the daemon applies the reserve when it thaws;
    # the client reads the late reply and releases the lease nobody will publish.
    with daemon.client() as c:
        session = c.session
        channel = ControlChannel(c.endpoint, 0.5)
        with _frozen(daemon):
            with pytest.raises(DaemonUnavailableError):
                channel.call("reserve", session=session.token, nbytes=1 << 20, consumers=1)
        daemon.wait_for(lambda s: s["counters"]["reserves"] == 1, what="the thawed daemon to apply the reserve")
        channel.call("ping")  # reads the late reply on the way
        s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="the late lease to be released")
        assert s["counters"]["releases"] == 1
        channel.close()


def test_a_down_daemon_costs_one_timeout_then_inline_at_once_and_reports_arrive(daemon) -> None:
    with daemon.client(inline_threshold=0, timeout=0.5) as c:
        c.connect()
        with _frozen(daemon):
            for _ in range(20):
                assert c.put(torch.ones(1000)).is_inline
        assert c.fallbacks["unreachable"] == 20
        # Only the first put waited for the daemon: one late reserve, not twenty.
        s = daemon.wait_for(lambda s: s["counters"]["fallbacks"].get("unreachable") == 20, what="the fallback report")
        assert s["counters"]["late_requests"] == 1
        # The background probe (once a second) notices the daemon is back: puts use the pool again. Until
        # a deadline, not for a number of puts, which a fast machine makes within the probe's second.
        deadline = time.monotonic() + 30
        while (d := c.put(torch.ones(1000))).is_inline and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not d.is_inline
        c.ack(d)
    assert daemon.pool()["used"] == 0


def test_fallback_reports_survive_a_daemon_restart(daemon_factory, runtime_dir) -> None:
    d1 = daemon_factory("--pool-mb", "16")
    c = d1.client(inline_threshold=0, timeout=0.5)
    c.connect()
    d1.proc.kill()
    d1.proc.wait()
    for _ in range(30):
        assert c.put(torch.ones(1000)).is_inline
    d2 = daemon_factory("--pool-mb", "16")
    d2.wait_for(lambda s: s["counters"]["fallbacks"].get("unreachable") == 30, what="the fallbacks to be reported")
    c.close()
    assert d2.stats()["counters"]["fallbacks"]["unreachable"] == 30


def test_quota_keeps_one_producer_from_holding_the_pool(daemon_factory) -> None:
    d = daemon_factory("--pool-mb", "16", "--max-session-mb", "1")
    with d.client(inline_threshold=0) as hog, d.client(inline_threshold=0) as other:
        held = [hog.put(torch.ones(64 * 1024)) for _ in range(5)]  # 256 KiB each: four fit in 1 MiB
        assert [h.is_inline for h in held] == [False] * 4 + [True]
        assert hog.fallbacks["over_quota"] == 1
        fine = other.put(torch.ones(64 * 1024))
        assert not fine.is_inline
        with d.client(inline_threshold=0, fallback="error") as strict:
            mine = [strict.put(torch.ones(64 * 1024)) for _ in range(4)]
            with pytest.raises(MmfeatError) as info:
                strict.put(torch.ones(64 * 1024))
            assert info.value.code is ErrorCode.OVER_QUOTA and "max_session_mb" in info.value.message
        for h in held[:4] + [fine] + mine:
            other.ack(h)
    s = d.wait_for(lambda s: s["pools"][0]["used"] == 0, what="acks")
    assert s["counters"]["over_quota"] == 2


def test_expiry_queue_follows_live_leases_not_throughput(daemon) -> None:
    with daemon.client(inline_threshold=0) as c:
        keep = c.put(torch.ones(1000), consumers=1)
        for _ in range(1500):
            c.ack(c.put(torch.ones(1000)))
        s = daemon.stats()
        # Two deadlines per lease (reserve, then publish) x 1500 leases without compaction.
        assert s["timers"] <= 2 * s["leases"]["PUBLISHED"] + 64 + 2, s["timers"]
        c.ack(keep)
