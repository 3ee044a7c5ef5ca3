"""What one session of the allowed group can make the daemon's sweep do (SPEC.md, section 9): the
range the sweep reads shrinks as slots free, a session's single slots are capped, and a session whose
slots keep holding words the daemon refuses is cut."""

from __future__ import annotations

import json

import pytest
import torch

from mmfeat.protos import ErrorCode, MmfeatError
from mmfeat.protos.lease_table import FREE, PUBLISHED, STATE, state_word

from . import workers as w
from .chaos import hostile
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
        # 5 MiB: its arena size class (16 MiB) is over an eighth of the pool, so it reserves, and goes inline
        big = c.put(torch.ones(5 << 18))
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


def test_a_session_whose_slots_keep_holding_refused_words_is_cut_and_reclaimed(daemon_factory) -> None:
    """Words refused in slots a session holds are charged to it: past max_refused_words it is cut. Its
    leases end (published ones too), its arena goes back, its fd channel is closed, the cut is counted
    and logged, its next request is told SESSION_CUT, and an honest session carries on."""
    daemon = daemon_factory("--pool-mb", "64", "--max-refused-words", "50")
    with daemon.client(inline_threshold=0) as honest, daemon.client() as c:
        hostile = HostileTable(daemon, c)
        try:
            token = hostile.session
            refs = [c.request("reserve", session=token, nbytes=4096, consumers=1)["lease"] for _ in range(20)]
            a = hostile.arena()
            hostile.publish(a["slot_base"], 1, a["pool"], a["offset"], 8192)
            kept = honest.put(torch.arange(4096, dtype=torch.float32))
            # An honest lease above the hostile ones keeps their slots in the swept range after the cut.
            above = honest.request("reserve", session=honest.session.token, nbytes=1, consumers=1)["lease"]
            s = daemon.stats()
            assert s["leases"] == {"RESERVED": 21, "PUBLISHED": 2}
            for rnd in range(1, 4):  # 20 refused words a sweep: past 50 in the third
                for ref in refs:
                    hostile.write(ref["lease"], STATE, state_word(ref["gen"] + rnd, PUBLISHED))
                s = daemon.stats()
            counters = s["counters"]
            assert counters["sessions_cut"] == 1 and counters["leases_cut"] == 21, counters
            assert 50 < counters["bad_table_words"] <= 60
            assert s["leases"] == {"RESERVED": 1, "PUBLISHED": 1} and s["pools"][0]["arenas"]["count"] <= 1
            hostile.sock.settimeout(5)
            assert hostile.sock.recv(4096) == b"", "the cut session's fd channel is closed"
            with pytest.raises(MmfeatError) as info:
                c.request("reserve", session=token, nbytes=4096, consumers=1)
            assert info.value.code is ErrorCode.SESSION_CUT and "max_refused_words" in info.value.message
            refused = s["counters"]["bad_table_words"]
            for ref in refs:  # its slots are nobody's now: rewriting them is refused in bulk, charged to none
                hostile.write(ref["lease"], STATE, state_word(ref["gen"] + 9, PUBLISHED))
            s = daemon.stats()
            assert s["counters"]["sessions_cut"] == 1 and s["counters"]["bad_table_words"] == refused + 20
            assert all(hostile.read(ref["lease"], STATE) == state_word(ref["gen"], FREE) for ref in refs)
            honest.request("release", session=honest.session.token, lease=above)
            assert torch.equal(honest.get(kept), torch.arange(4096, dtype=torch.float32))
            honest.ack(kept)
            assert honest.flush()
        finally:
            hostile.close()
    s = daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="everything freed")
    assert s["counters"]["arenas_freed"] == s["counters"]["arenas_granted"]
    assert daemon.stop() == 0
    err = daemon.proc.communicate()[1]
    assert "past max_refused_words (50); 21 lease(s) ended, 1 arena(s) taken back" in err, err[-2000:]
    assert "STATE of 20 slot(s) no session holds changed" in err, "refused as one batch, not word by word"


def test_honest_clients_succeed_while_a_member_attacks_through_the_table(daemon_factory, children, tmp_path) -> None:
    """A member floods reserves, releases them, and rewrites the words of every slot it held, flat out,
    session after session (tests/chaos/hostile.py). Meanwhile an honest producer's every put reaches
    the pool (fallback="error"), its consumer reads every byte right, and every ping is answered: the
    member's reserves stop at its cap, and its sessions are cut."""
    daemon = daemon_factory("--pool-mb", "256", "--max-session-leases", "512", "--max-refused-words", "1024",
                            "--ack-ttl", "20")
    rt, ctx, out = str(daemon.runtime_dir), children, tmp_path / "hostile.json"
    stop = ctx.Event()
    attacker = ctx.Process(target=hostile.attack, args=(rt, 300.0, 100_000, out, stop))
    attacker.start()
    try:
        daemon.wait_for(lambda s: s["counters"]["sessions_cut"] >= 1, timeout=60, what="the member's first cut")
        q, results = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=w.consume, args=(rt, q, results, False)),
                 ctx.Process(target=w.produce, args=(rt, 1, q))]
        for p in procs:
            p.start()
        pings = 0
        with daemon.client() as c:
            while procs[1].is_alive() or pings == 0:
                assert c.request("ping")["epoch"]  # raises if it is not answered
                pings += 1
        got = results.get(timeout=300)
        assert got == ("ok", len(w.cases()) + 1), got
        for p in procs:
            p.join(60)
            assert p.exitcode == 0, "an honest put failed (its producer uses fallback='error')"
    finally:
        stop.set()
        attacker.join(60)
        if attacker.is_alive():
            attacker.kill()
    counts = json.loads(out.read_text())
    s = daemon.stats()
    assert counts["reserves_refused"] >= 1 and counts["reserves"] <= 512 * counts["sessions"], counts
    assert counts["words_written"] > 0 and s["counters"]["sessions_cut"] >= 1 and s["counters"]["bad_table_words"] > 0
    # Garbage the member wrote into its own arena may pass every check: a feature, ended by ack_ttl.
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0 and s["clients"] == 0, timeout=40, what="everything back")


def test_words_written_into_a_block_before_it_is_granted_are_not_charged_to_its_new_holder(daemon_factory) -> None:
    """The slots of the next arena block lie outside both swept ranges until it is granted, so a peer's
    words there are never put back by a sweep. The grant puts the daemon's own words back: the session
    that gets the block is charged nothing for what was written before it held it, and publishes there."""
    daemon = daemon_factory("--pool-mb", "64", "--max-refused-words", "50")
    with daemon.client() as attacker, daemon.client(inline_threshold=0) as victim:
        hostile = HostileTable(daemon, attacker)
        try:
            block = 256
            top = hostile.slots - hostile.slots % block
            assert daemon.stats()["swept_slots"] == 0
            for slot in range(top - block, top):  # the block the first arena gets
                hostile.write(slot, STATE, state_word(7, PUBLISHED))
            assert daemon.stats()["counters"]["bad_table_words"] == 0, "outside the swept ranges"
            x = torch.arange(4096, dtype=torch.float32)
            desc = victim.put(x)
            assert not desc.is_inline and top - block <= desc.lease < top, desc
            s = daemon.stats()
            assert (s["counters"]["sessions_cut"], s["counters"]["bad_table_words"]) == (0, 0)
            assert torch.equal(victim.get(desc), x)
            victim.ack(desc)
            assert victim.flush()
            again = victim.put(x + 1)
            assert torch.equal(victim.get(again), x + 1)
            victim.ack(again)
            assert victim.flush()
        finally:
            hostile.close()
    daemon.wait_for(lambda s: s["pools"][0]["used"] == 0, what="everything freed")
