"""Short TTLs without races, for the tests whose point is a TTL passing while something else holds on.

A short TTL keeps such a test quick, but a busy machine can pause the test between two calls for longer
than any fixed TTL: what must come before the TTL would then come after it, and the test would fail for
the machine's speed. These helpers start the clock only once everything else is ready, say when it has
surely run out, and where the machine was slower than the TTL after all, try again with a longer one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

# Each try's TTL is this many times the last one's: four tries reach 64 times the first.
GROWTH = 4.0
TRIES = 4


def ttls(first: float, tries: int = TRIES) -> Iterator[float]:
    """``first``, then ever longer TTLs: one per try at what must come before the TTL ran out."""
    for k in range(tries):
        yield first * GROWTH ** k


@dataclass
class Held:
    key: str
    hold: object  # the hold's Descriptor
    ttl: float
    ran_out_by: float  # time.monotonic() by which the feature's retain_ttl has certainly passed
    lost: int  # earlier tries whose feature ran out before its hold (each counted in retained_expired)


def put_and_hold(put: Callable[[str, float], None], hold: Callable[[str], Optional[object]],
                 key: Callable[[int], str], first_ttl: float) -> Held:
    """A retained feature put under ``key(k)`` with a retain_ttl, then held, before that TTL ran out.

    ``put(key, ttl)`` puts it; ``hold(key)`` holds it (None: nothing live under the key, as after the
    TTL). A hold that finds nothing where the TTL had already run out was the machine's slowness: the
    next try puts under a new key with a longer TTL. A hold that finds nothing within the TTL fails."""
    for k, ttl in enumerate(ttls(first_ttl)):
        put(key(k), ttl)
        put_returned = time.monotonic()  # the daemon started the TTL before this
        h = hold(key(k))
        if h is not None:
            return Held(key(k), h, ttl, put_returned + ttl, k)
        assert time.monotonic() - put_returned >= ttl, f"nothing live under {key(k)!r} within its retain_ttl {ttl}"
    raise AssertionError(f"no hold came within a retain_ttl of {ttl} s, {k + 1} tries")


# What a read of a feature that ack_ttl ended raises.
EXPIRED = "expired waiting for acks after ack_ttl"


def ran_out(stderr: str, since: float, ttl: float) -> bool:
    """Whether a read failed (``stderr``: what its process printed) because the feature's ack_ttl ran out
    first: the machine was slower than the TTL. Its error says so, and ``ttl`` seconds have passed
    ``since`` (a time.monotonic() from before the put); an expiry any sooner is a failure of its own."""
    return EXPIRED in stderr and time.monotonic() - since >= ttl


def sleep_until(when: float) -> None:
    """Until time.monotonic() is past ``when``: a TTL that ran out by then certainly has."""
    while (left := when - time.monotonic()) > 0:
        time.sleep(left + 0.01)
