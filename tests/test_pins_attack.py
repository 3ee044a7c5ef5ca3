"""Attacks on pins (SPEC.md, sections 3, 5 and 12) against a real mmfeatd, with the attackers in processes
of their own: hostile members of the group rewriting ACKS words, racing pinners, hostile subscribers."""

from __future__ import annotations

import pytest
import torch

from mmfeat.client import Namespace

from . import pin_attack_workers

NS = Namespace(framework="vllm", version="0.32.0", model="pins-attack", dtype="float32")


def _published(s: dict) -> int:
    return s["leases"]["PUBLISHED"]


@pytest.mark.xfail(strict=True, reason="close_pins/_note_pins restart the ack_ttl wait each time the word's taken "
                   "changes, so a word rewritten faster than ack_ttl keeps a doomed feature for ever")
def test_a_hostile_word_that_keeps_changing_pins_a_feature_no_longer_than_ack_ttl(daemon_factory, children) -> None:
    """A member of the group rewrites a retained feature's ACKS word between 1 and 2 pins taken, every
    50 ms. Its retain_ttl (1 s) passes: the daemon may wait for those pins ack_ttl (1 s) after it saw them,
    and no longer (SPEC.md, section 9: client bytes in the word pin a feature for ack_ttl at most)."""
    d = daemon_factory("--ack-ttl", "1")
    key = NS.key("flapped")
    with d.client() as c:
        desc = c.put(torch.ones(4096), key=key, retain_ttl=1.0)
        out, stop = children.Queue(), children.Queue()
        p = children.Process(target=pin_attack_workers.flapper, args=(str(d.runtime_dir), desc.to_bytes(), out, stop))
        p.start()
        try:
            assert out.get(timeout=60) == "started"
            # retain_ttl 1 s, then ack_ttl 1 s after the daemon saw the pins; 8 s leaves slack for sweeps.
            d.wait_for(lambda s: _published(s) == 0, timeout=8.0,
                       what="the flapped feature to end ack_ttl after its retain_ttl")
            assert out.get(timeout=30) > 0
        finally:
            stop.put("stop")
            p.join(30)
        assert p.exitcode == 0
        assert not c.has(key)
