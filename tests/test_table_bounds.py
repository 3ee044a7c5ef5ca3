"""What one session of the allowed group can make the daemon's sweep do (SPEC.md, section 9): the
range the sweep reads shrinks as slots free, a session's single slots are capped, and a session whose
slots keep holding words the daemon refuses is cut."""

from __future__ import annotations

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
