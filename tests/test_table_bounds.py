"""What one session of the allowed group can make the daemon's sweep do (SPEC.md, section 9): the
range the sweep reads shrinks as slots free, a session's single slots are capped, and a session whose
slots keep holding words the daemon refuses is cut."""

from __future__ import annotations

import pytest
import torch

from mmfeat.protos import ErrorCode, MmfeatError
from mmfeat.protos.lease_table import PUBLISHED, STATE, state_word

from .test_table_attacks import HostileTable


def test_the_swept_range_shrinks_when_a_session_frees_its_single_slots(daemon) -> None:
    """A session that once reserved many leases leaves no wide range behind: once they are released the
    sweep reads none of their slots, and words a peer writes there are never looked at again."""
    with daemon.client() as c:
        hostile = HostileTable(daemon, c)
        try:
            refs = [c.request("reserve", session=c.session.token, nbytes=1, consumers=1)["lease"] for _ in range(300)]
            assert daemon.stats()["swept_slots"] == 300
            keep = refs[10]  # a low slot stays held: the range ends just above it
            for ref in refs[:10] + refs[11:]:
                c.request("release", session=c.session.token, lease=ref)
            s = daemon.stats()
            assert s["swept_slots"] == keep["lease"] + 1, s["swept_slots"]
            for ref in refs[11:]:  # rewriting the freed slots costs the daemon nothing now
                hostile.write(ref["lease"], STATE, state_word(ref["gen"] + 1, PUBLISHED))
            s = daemon.stats()
            assert s["counters"]["bad_table_words"] == 0 and s["swept_slots"] == keep["lease"] + 1
            again = c.request("reserve", session=c.session.token, nbytes=1, consumers=1)["lease"]
            assert again["lease"] == refs[0]["lease"], "the lowest free single slot is taken first"
            for ref in (keep, again):
                c.request("release", session=c.session.token, lease=ref)
            assert daemon.stats()["swept_slots"] == 0
        finally:
            hostile.close()


def test_a_session_holds_at_most_max_session_leases_single_slots(daemon_factory) -> None:
    """Each reserved lease holds a single slot, whose range every sweep reads: past the cap a session's
    reserve is refused with OVER_QUOTA (its put goes inline), while other sessions still reserve."""
    daemon = daemon_factory("--pool-mb", "64", "--max-session-leases", "8")
    with daemon.client() as c, daemon.client() as other:
        refs = [c.request("reserve", session=c.session.token, nbytes=1, consumers=1)["lease"] for _ in range(8)]
        with pytest.raises(MmfeatError) as info:
            c.request("reserve", session=c.session.token, nbytes=1, consumers=1)
        assert info.value.code is ErrorCode.OVER_QUOTA and "max_session_leases" in info.value.message
        big = c.put(torch.ones(1 << 20))  # 4 MiB, more than half an arena here: it reserves, and goes inline
        assert big.is_inline and c.fallbacks.get("over_quota") == 1
        theirs = other.request("reserve", session=other.session.token, nbytes=1, consumers=1)["lease"]
        c.request("release", session=c.session.token, lease=refs.pop())
        refs.append(c.request("reserve", session=c.session.token, nbytes=1, consumers=1)["lease"])
        s = daemon.stats()
        arena_slots = 256 * s["pools"][0]["arenas"]["count"]  # the put asked for an arena on its way
        assert s["counters"]["over_quota"] == 2 and s["swept_slots"] == 9 + arena_slots
        for ref in refs:
            c.request("release", session=c.session.token, lease=ref)
        other.request("release", session=other.session.token, lease=theirs)
    assert daemon.pool()["used"] == 0
