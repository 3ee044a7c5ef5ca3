"""The consumer's book of staged copies in flight (client/consume/pinned.py, PendingCopies) stays within its
bound, and forgets no copy before it has completed: an ack that finds nothing to wait for frees bytes
at once, and a DMA may still be reading them."""

from __future__ import annotations

from mmfeat.client.consume.pinned import PendingCopies


class _Copy:
    """Stands in for the torch.cuda.Event a staged get records: complete once synchronized."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_staged_copies_still_in_flight_stay_within_the_bound() -> None:
    pending = PendingCopies(limit=8)
    copies = [_Copy() for _ in range(100)]
    for i, copy in enumerate(copies):
        pending.add(("node", 1, i, 1), copy)
        assert len(pending) <= 8, f"{len(pending)} copies remembered after {i + 1}, past a bound of 8"
    forgotten = copies[:-8]
    assert all(c.done for c in forgotten), "a copy was forgotten while it was still in flight"
    assert not any(c.done for c in copies[-8:]), "a copy within the bound was waited for"
    assert pending.take(("node", 1, 99, 1)) is copies[99] and pending.take(("node", 1, 0, 1)) is None


def test_completed_copies_are_forgotten_without_a_wait() -> None:
    pending = PendingCopies(limit=2)
    done = [_Copy() for _ in range(5)]
    for c in done:
        c.done = True
    for i, c in enumerate(done):
        pending.add(("node", 1, i, 1), c)
    assert len(pending) == 2
