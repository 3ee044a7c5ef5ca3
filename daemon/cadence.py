"""How often the control loop wakes: its housekeeping tick, and sweeps of the lease table that follow
the rate at which clients write it.
"""

from __future__ import annotations

# Housekeeping (stale handshakes, unattached sessions) runs this often while clients are connected;
# lease expiry wakes the loop at the earliest deadline instead, so it is on time whatever this is.
# While features flow, the daemon's cost is its wake-ups, not its work: each starts with caches that
# payload copies of many MiB emptied, so wake-ups per second times that is its CPU (docs/performance.md).
# Large features come a few dozen a second, so a wake-up every few hundred milliseconds would cost
# more per feature than the sweep's work on it: housekeeping whose deadlines are seconds waits a second.
TICK_S = 1.0
# A mesh's heartbeats and a remote pull's waiters keep a finer tick, and a meshed daemon sweeps at
# least this often too: a remote consumer's ack of a pulled copy reaches the owner only once its own
# daemon's sweep has seen it, and until then the owner's producer cannot reuse that space.
MESH_TICK_S = 0.1
# Sweeps of the lease table: see sweep_interval. The longest interval bounds how late a daemon that
# was idle frees the first acked feature (and stats and every lease op sweep first, whatever it is).
SWEEP_MIN_S = 0.005
# A trickle of features, too, is swept at most this often, as an idle client is. Producers wait for no
# sweep (DONE gives their space back); an arena's slots come back at a sweep, and a rate that would use
# half of them between two sweeps halves the interval (SWEEP_BATCH), so the slots, not this, set the
# pace of a fast producer, and a slow one (large features) costs one wake-up a second, not several.
SWEEP_MAX_S = 1.0
# While clients write, a sweep should apply a batch of words: its fixed cost (numpy over the columns,
# and, with payload copies of many MiB evicting the daemon from the caches, a cold start of a few
# hundred microseconds) is then shared by many features instead of one or two. The upper bound keeps
# a sweep's batch well under an arena's slots (256 by default), which only a sweep's FREE hands back.
SWEEP_BATCH = (64, 128)
# With no client attached nothing can write to the table and nothing is live: the loop then wakes
# this rarely, for the timers alone (an idle daemon on every node should cost nothing).
IDLE_WAKE_S = 1.0


def sweep_interval(every: float, applied: int, longest: float = SWEEP_MAX_S) -> float:
    """The next sweep's interval after one that applied ``applied`` words. Since a feature's last ack
    hands its space back to the producer (DONE), nothing waits for a sweep but slots and the books, so
    while clients write the interval follows the rate: halved while sweeps find more than a batch,
    doubled while they find less, up to ``longest`` (SWEEP_MAX_S; a meshed daemon's is shorter)."""
    if applied > SWEEP_BATCH[1]:
        return max(SWEEP_MIN_S, min(every, longest) / 2)
    if applied < SWEEP_BATCH[0]:
        return min(longest, every * 2)
    return min(every, longest)
